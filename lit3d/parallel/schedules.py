"""The pipeline schedules lit3d runs, in one place: which PyTorch schedule each one is, what it needs (chunks per
rank, their placement, micro-batches), and its theory: the idle share of a step (the bubble) and the activations a
rank holds at its peak. The runtime metric ``pp/bubble_theory``, `lit3d plan` and ``benchmarks/pipeline_bubble.py``
all read them here.

Costs are those of one micro-batch on one rank's layers: F the forward, B the gradient of the input, W the gradient
of the weights (a backward that is not split costs B + W). A matmul costs the same in all three (2 FLOPs per weight
and token), so the default is 1 : 1 : 1 (`Costs.of`: under activation checkpointing W runs inside B). With ``p``
ranks, ``v`` chunks per rank and ``m`` micro-batches, a rank computes ``m (F + B + W)`` and idles, in the regime each
paper assumes:

====================  =============================  =========  ===========================  ======================
schedule              PyTorch class                  placement  idle per rank                peak in flight, rank r
====================  =============================  =========  ===========================  ======================
``gpipe``             ScheduleGPipe                  loop       (p-1)(F+B+W)                 m
``1f1b``              Schedule1F1B                   loop       (p-1)(F+B+W)                 p - r
``interleaved_1f1b``  ScheduleInterleaved1F1B        loop, v    (p-1)(F+B+W) / v             p + (p-1-2r) / v
``zero_bubble``       ScheduleInterleavedZeroBubble  loop, v    (p-1) max(F, F+B-W) / v      p
``zbv``               ScheduleZBVZeroBubble          V, 2       (p-1) max(F/2, B-W)          p
``dualpipev``         ScheduleDualPipeV              V, 2       (p-1) max(F, (F+2B-W) / 2)   p + 1/2
====================  =============================  =========  ===========================  ======================

Sources: GPipe (Huang et al. 2019) and 1F1B (Narayanan et al. 2021, PipeDream-Flush); interleaved 1F1B (Narayanan
et al. 2021, §2.2); ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism": a third of 1F1B's bubble at F = B = W,
with 1F1B's peak memory; DeepSeek-V3's table writes it (p-1)(F + B' - 2W), B' = B + W being the whole backward);
ZB-V (same paper: two chunks per rank in a V, zero bubble at F = B = W with 1F1B's memory) and DualPipe-V (DeepSeek-V3,
2024: (p-1)(F&B + B' - 3W) over chunks of half a rank, F&B a forward and a backward run as a pair; p + 1/2
micro-batches in flight).

Each formula was checked against a replay of PyTorch's own order of actions with free communication
(``benchmarks/pipeline_bubble.py``, its replay column) on a grid of costs W <= F <= B: the idle time of the first four
exactly for any costs; zbv's exactly at lit3d's costs (`Costs.of`) and on most of the grid (where B lies between F
and F + W, PyTorch's fixed order idles up to half as much again); dualpipev's exactly for B <= F and at most F/2 above
the replay for B > F; every peak exactly once the pipeline fills. NOTE two readings of the papers, both
from the replay. The "zero" of ZB-V leaves out the filling of the V: the last rank waits for p - 1 chunk forwards,
(p-1)F/2, a bound no schedule with two chunks per rank beats. DualPipe's pair overlaps a forward and a backward on
hardware that runs them at once; PyTorch runs the pair's halves one after the other and sends both results after the
pair, so F&B = F + B' here, and at F = B = W DualPipe-V idles as much as ZB-H1 (the formula above).

The regime: the formulas hold once the pipeline fills: m >= p, for the interleaved schedules a multiple of p, for the
V schedules m >= 2p. Below it a step idles more than they say (the replay shows how much).
"""

from __future__ import annotations

from dataclasses import dataclass

SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipev")  # backward split into input (B) and weight (W) gradients


@dataclass(frozen=True)
class Costs:
    """Time (any unit) of one micro-batch's forward, input gradient and weight gradient on a rank's layers."""

    forward: float = 1.0
    input_grad: float = 1.0
    weight_grad: float = 1.0

    @classmethod
    def of(cls, activation_checkpointing: bool | str) -> Costs:
        """Matmul costs of a block as lit3d runs it. Under activation checkpointing the backward runs whole (PyTorch
        recomputes once per backward call, so no weight gradient runs apart: `lit3d.strategies.pipelining.step`), and
        full recompute adds a forward to it."""
        if not activation_checkpointing:
            return cls(1.0, 1.0, 1.0)
        return cls(1.0, 3.0 if activation_checkpointing in (True, "full") else 2.0, 0.0)


MATMUL = Costs()


@dataclass(frozen=True)
class Schedule:
    """What lit3d knows of one pipeline schedule."""

    torch_class: str  # in `torch.distributed.pipelining`
    chunks: int | None  # chunks (virtual stages) per rank it runs: a fixed number, or None for virtual_pipeline_size
    placement: str = "loop"  # "loop": stage s on rank s % p; "v": rank r holds stages r and 2p-1-r
    forward_only: str | None = None  # the schedule that runs a single micro-batch forward (sampling), if not itself


SCHEDULES = {
    "gpipe": Schedule("ScheduleGPipe", chunks=1),
    "1f1b": Schedule("Schedule1F1B", chunks=1, forward_only="gpipe"),
    "interleaved_1f1b": Schedule("ScheduleInterleaved1F1B", chunks=None),
    "zero_bubble": Schedule("ScheduleInterleavedZeroBubble", chunks=None),
    "zbv": Schedule("ScheduleZBVZeroBubble", chunks=2, placement="v"),
    # NOTE: DualPipe-V needs at least 2p micro-batches; one forward (sampling) runs as ZB-V, on the same V.
    "dualpipev": Schedule("ScheduleDualPipeV", chunks=2, placement="v", forward_only="zbv"),
}


# NOTE: interleaved 1F1B on one chunk per rank is plain 1F1B under another name (its bubble is 1F1B's), so unset it
# runs two, the fewest that interleave (Megatron's virtual stages; the bubble halves). ``zero_bubble`` on one chunk is a
# schedule of its own (ZB-H1) and keeps one.
DEFAULT_CHUNKS = {"interleaved_1f1b": 2}


def check_composes(schedule: str, pp: int, compile: bool | str = False, zero_stage: int = 1) -> None:
    """Refuse what ``schedule`` cannot run with, naming both (asked before any process starts)."""
    if pp == 1 or schedule not in SPLIT_BACKWARD:
        return
    instead = "or pipeline_schedule='1f1b' or 'interleaved_1f1b'"
    if compile:
        raise ValueError(
            f"compile={compile!r} cannot run pipeline_schedule={schedule!r}: its backward is split into input and "
            "weight gradients, which compiled blocks do not allow (PyTorch refuses it too); use compile=False, "
            + instead
        )
    if zero_stage == 3:
        # NOTE: measured: ZeRO-3 reshards each block after its forward; a weight gradient run after the next
        # micro-batch's forward is then not all added to the parameters' (the loss leaves one process's by 1e-2).
        raise ValueError(
            f"zero_stage=3 cannot run pipeline_schedule={schedule!r}: ZeRO-3 reshards each block after its forward, "
            "and PyTorch's weight gradients, run later apart from the input gradients, then miss part of their "
            f"parameters; use zero_stage=2 (parameters gathered once per schedule and kept), {instead}"
        )


def chunks_per_rank(schedule: str, virtual: int | None) -> int:
    """The chunks each rank runs: what ``schedule`` needs, checked against ``virtual_pipeline_size`` (None: its
    default, `DEFAULT_CHUNKS` or 1)."""
    fixed = SCHEDULES[schedule].chunks
    if fixed is None or virtual in (None, fixed):
        return virtual or fixed or DEFAULT_CHUNKS.get(schedule, 1)
    if fixed == 1:
        takes = " or ".join(repr(name) for name, s in SCHEDULES.items() if s.chunks is None)
        raise ValueError(f"virtual_pipeline_size={virtual} needs pipeline_schedule={takes}, not {schedule!r}")
    raise ValueError(
        f"pipeline_schedule={schedule!r} runs exactly {fixed} chunks per rank (rank r holds stages r and 2p-1-r, "
        f"a V), so virtual_pipeline_size={virtual} cannot be; leave it unset or set it to {fixed}"
    )


def microbatch_problem(pp: int, schedule: str, m: int) -> str | None:
    """Why ``m`` micro-batches cannot run ``schedule`` on ``pp`` ranks (None if they can): PyTorch's own limits."""
    if pp == 1:
        return None
    if schedule == "1f1b" and m < pp:
        return f"pipeline_schedule='1f1b' needs num_microbatches >= pipeline_parallel_size={pp}, got {m}"
    if schedule in ("interleaved_1f1b", "zero_bubble") and m % max(1, m // pp):
        return (
            f"pipeline_schedule={schedule!r} needs num_microbatches={m} to be a multiple of "
            f"pipeline_parallel_size={pp} (or at most it)"
        )
    if schedule == "dualpipev" and m < 2 * pp:
        return (
            f"pipeline_schedule='dualpipev' needs num_microbatches >= 2 x pipeline_parallel_size = {2 * pp} (one per "
            f"stage of the V), got {m}"
        )
    return None


def idle_time(schedule: str, pp: int, virtual: int = 1, costs: Costs = MATMUL) -> float:
    """Time a rank idles per step, in the units of ``costs`` (see the table above)."""
    p, v = pp, SCHEDULES[schedule].chunks or virtual
    f, b, w = costs.forward, costs.input_grad, costs.weight_grad
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        return (p - 1) * (f + b + w) / v
    if schedule == "zero_bubble":
        return (p - 1) * max(f, f + b - w) / v
    if schedule == "zbv":
        return (p - 1) * max(f / 2, b - w)
    return (p - 1) * max(f, (f + 2 * b - w) / 2)  # dualpipev: its pairs run one half after the other


def bubble_theory(schedule: str, pp: int, microbatches: int, virtual: int = 1, costs: Costs = MATMUL) -> float:
    """The idle share of a step, ``idle / (m (F + B + W) + idle)``: what ``pp/bubble`` measures."""
    idle = idle_time(schedule, pp, virtual, costs)
    return idle / (microbatches * (costs.forward + costs.input_grad + costs.weight_grad) + idle)


def peak_in_flight(schedule: str, pp: int, microbatches: int, virtual: int, rank: int) -> float:
    """Micro-batches whose activations (of all of ``rank``'s layers) are held at once at the peak, counted from a
    chunk's forward to its weight gradient (at most: between its input and weight gradients part is freed)."""
    p, m, r = pp, microbatches, rank
    if p == 1:
        return 1.0  # gradient accumulation runs one micro-batch at a time
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - r))
    v = SCHEDULES[schedule].chunks or virtual
    per_round = m // max(1, m // p)  # PyTorch's rounds of micro-batches through the chunks
    if schedule == "interleaved_1f1b":  # its warm-up: (v-1) rounds and two forwards per rank after r
        return min(m * v, (v - 1) * per_round + 2 * (p - 1 - r) + 1) / v
    if schedule == "zero_bubble":  # rank r defers its weight gradients by r: every rank holds p (ZB-H1)
        return min(m * v, (v - 1) * per_round + p) / v
    if schedule == "zbv":
        return float(min(m, p))
    return min(m, p + 0.5)  # dualpipev: 2p + 1 chunks of half a rank's layers


def last_stage_in_flight(schedule: str, pp: int, microbatches: int) -> int:
    """Micro-batches whose loss (the logits' gradient: what the head's weight gradient needs) the last stage holds
    at once: one where its backward follows each forward, m in GPipe, p in the zero-bubble loop, which defers the last
    rank's weight gradients by p - 1 micro-batches."""
    if pp == 1 or schedule not in ("gpipe", "zero_bubble"):
        return 1
    return microbatches if schedule == "gpipe" else min(microbatches, pp)


def describe_schedule(schedule: str, pp: int, microbatches: int, virtual: int) -> str:
    """One line for the rank-0 layout log: the schedule, its micro-batches, chunks per rank and bubble."""
    return (
        f"pipeline: {schedule} over {pp} ranks, {virtual} chunk(s) per rank ({pp * virtual} stages), "
        f"{microbatches} micro-batches per schedule; bubble {bubble_theory(schedule, pp, microbatches, virtual):.3f} "
        "of the step in theory (forward = backward = weight-gradient time)"
    )
