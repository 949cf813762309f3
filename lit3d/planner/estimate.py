"""Memory, communication, bubble and step time of one layout: arithmetic only, no GPU.

What is planned is described by three values: the `Cluster`, the training loop's numbers (`Training`) and the run's
settings, the `lit3d.parallel.Parallelism` the strategy is built from (its sizes resolved into a `Layout`).

Parameter shapes come from the model's config (the real model's, `lit3d.planner.shapes`), and each tensor's split
from the model's tensor-parallel plan, the strategy's pipeline partition and its ZeRO rules, so the per-rank counts
are exact (`lit3d plan --verify` checks them against the real parallelised model). Activations follow the per-layer
accounting of Korthikanti et al. (2022) for this architecture (RMSNorm, SwiGLU, grouped-query attention, fused
attention that stores no score matrix: `lit3d.planner.memory`). Step time is a simple roofline: matmul time at an
assumed efficiency, tensor-parallel and pipeline traffic exposed, data-parallel traffic hidden behind backward where
it fits, the whole stretched by the pipeline bubble.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lit3d.config import GPTConfig
from lit3d.parallel.layout import Layout
from lit3d.parallel.precision import is_bf16_mixed, keeps_master_weights
from lit3d.parallel.schedules import Costs, bubble_theory
from lit3d.parallel.settings import Parallelism
from lit3d.planner.memory import (  # noqa: F401 (the per-token counts are also read from here)
    Memory,
    activation_bytes_per_token,
    autocast_weight_bytes,
    memory_by_stage,
    output_layer_bytes,
    params_total,
)
from lit3d.planner.tensors import config_key
from lit3d.planner.traffic import collectives, communication_bytes

GB = 1e9


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter held as weights, gradients and optimizer state, and per stored activation; and per
    element on the wire: ``gathered`` for FSDP's parameter gathers, ``reduced`` for gradient reductions (default:
    as held); ``stepped``: of the tensors the optimizer steps (default: the weights; fp32 master weights)."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    gathered: int | None = None
    reduced: int | None = None
    stepped: int | None = None

    @property
    def gather_bytes(self) -> int:
        return self.weights if self.gathered is None else self.gathered

    @property
    def reduce_bytes(self) -> int:
        return self.grads if self.reduced is None else self.reduced

    @property
    def stepped_bytes(self) -> int:
        return self.weights if self.stepped is None else self.stepped


# Bytes per element a lit3d run holds and sends, by Lightning's precision: the one table both the search and the run's
# own estimate (`lit3d.planner.run.plan_of_run`) read, through `held_precision`.
PRECISIONS = {
    "32-true": Precision(4, 4, 8, 4),  # fp32 everything; AdamW's two moments
    "bf16-true": Precision(2, 2, 4, 2),
    # fp32 parameters computed in bf16 (`lit3d.strategies.precision`): FSDP2's shards gathered in bf16, DDP's replicas
    # cast by autocast (its bf16 copies are activations: `autocast_weight_bytes`); gradients reduced in fp32.
    "bf16-mixed": Precision(4, 4, 8, 2, gathered=2, reduced=4),
    "16-mixed": Precision(4, 4, 8, 2),
}
# ZeRO-1 under bf16-mixed (`keeps_master_weights`): bf16 parameters; in the optimizer's slices the fp32 master weights,
# both moments and the fp32 gradient; the updated slices all-gathered in bf16. Megatron's distributed optimizer:
# 2 + (4 + 12) / D bytes per parameter.
MASTER_WEIGHTS = Precision(2, 4, 12, 2, gathered=2, reduced=4, stepped=4)


@dataclass
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    intra_node_gbps: float = 450.0  # NVLink, GB/s per direction
    inter_node_gbps: float = 50.0  # InfiniBand share of one GPU, GB/s
    peak_tflops: float = 989.0  # dense bf16
    # The α of the α-β model, from NCCL's own tuning model (src/graph/tuning.cc, ring algorithm, Simple protocol):
    # a base latency per collective and a hardware latency per ring hop, over NVLink and over the network.
    collective_latency_us: float = 8.4
    intra_node_hop_us: float = 5.7
    inter_node_hop_us: float = 6.6
    # The link between DiLoCo's islands (datacenters), per GPU as the links above: about a hundredth of InfiniBand's
    # bandwidth, and milliseconds of latency per hop.
    inter_island_gbps: float = 1.0
    inter_island_latency_ms: float = 10.0
    device: str = "GPU"  # what the reports call one rank's device ("CPU process" for a rehearsal on CPU)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Training:
    """The training loop's numbers; the run's settings (ZeRO, schedule, recompute, ...) are its `Parallelism`."""

    seq_len: int = 2048
    micro_batch_size: int = 1
    global_batch_size: int = 512  # sequences per optimizer step
    # Micro-steps per optimizer step that each run a whole pipeline schedule (pp > 1): the schedule then has
    # global_batch_size / (dp x micro_batch_size x accumulate_grad_batches) micro-batches. Without a pipeline
    # every micro-batch is a micro-step of its own already.
    accumulate_grad_batches: int = 1
    precision: str = "bf16-mixed"  # Lightning's
    efficiency: float = 0.6  # share of the peak that matmuls reach
    headroom: float = 0.1  # of GPU memory kept free for the allocator, CUDA context and buffers

    def schedules_per_step(self, pp: int) -> int:
        """Pipeline schedules run per optimizer step (gradient accumulation repeats the whole schedule)."""
        return self.accumulate_grad_batches if pp > 1 else 1


@dataclass
class Plan:
    layout: dict[str, int]
    # Bytes on the most loaded rank: what it holds of each kind at most, and its peak (``total``: the most of backward's
    # start, its end and the optimizer step, not their sum, `buffers.peak_memory`), with the buffers of that moment.
    memory_per_gpu: dict[str, int]
    communication_per_step: dict[str, dict[str, float]]  # per axis: bytes (per GPU) and seconds
    pipeline_bubble: float
    step_time_s: float
    mfu: float
    fits: bool
    num_microbatches: int
    memory_by_stage: list[dict[str, int]] = field(default_factory=list)
    flops_per_step: float = 0.0  # model FLOPs of one optimizer step, all GPUs (recompute not counted)
    params_total: int = 0
    params_per_rank: int = 0  # parameters (elements) the most loaded rank holds, ZeRO-3 shards included
    params_active: int = 0  # parameters one token uses (MoE: k of the routed experts; a dense model: all)
    activation_bytes_per_layer: int = 0  # what one block keeps for backward, per micro-batch on one rank
    pipeline_schedule: str | None = None  # with a pipeline: the schedule this estimate runs
    # With a pipeline: every schedule the planner weighed for this layout (`lit3d.planner.pipeline`), each with its
    # micro-batches, bubble, step time and activations.
    schedule_candidates: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# The settings the planner assumes where none are given: the strategy's defaults, with sequence parallelism on (with
# tensor parallelism it only saves memory and traffic).
PLANNING_DEFAULTS = Parallelism(sequence_parallel=True)


def held_precision(training: Training, settings: Parallelism, layout: Layout) -> Precision:
    """Bytes per element that a lit3d run of ``training`` with ``settings`` on ``layout`` holds and sends:
    ``training.precision``'s row of `PRECISIONS`, or `MASTER_WEIGHTS` where the strategy keeps master weights, with
    the reduce dtype asked for (``settings.mixed_precision_reduce``)."""
    precision = PRECISIONS[training.precision]
    if keeps_master_weights(training.precision, settings.zero_stage, layout.replicas):
        precision = MASTER_WEIGHTS
    if is_bf16_mixed(training.precision) and settings.mixed_precision_reduce == "bfloat16":
        precision = replace(precision, reduced=2)
    return precision


def estimate(
    config: GPTConfig,
    cluster: Cluster,
    layout: Layout,
    training: Training,
    settings: Parallelism = PLANNING_DEFAULTS,
) -> Plan:
    """Memory, communication, bubble and step time of ``layout`` (no checks: see `search.layout_problem`).

    ``settings``: the run's; its sizes are ``layout``'s (those ``settings`` holds are not read)."""
    precision = held_precision(training, settings, layout)
    memory = memory_by_stage(config, layout, training, settings, precision)
    traffic = communication_bytes(config, layout, training, settings, precision)
    links = link_speeds(cluster, layout)
    latency = latencies(cluster, links, collectives(config, layout, training, settings))
    seconds = {axis: traffic[axis] / (links[axis] * GB) + latency[axis] for axis in traffic}
    time = step_time(config, cluster, layout, training, settings, seconds)
    return Plan(
        layout=planned_layout(layout, settings),
        memory_per_gpu=memory.peak,
        memory_by_stage=memory.by_stage,
        communication_per_step={
            axis: {
                "bytes": traffic[axis],
                "seconds": seconds[axis],
                "latency_s": latency[axis],
                "link_gbps": links[axis],
                **({"hidden_s": time.hidden[axis]} if axis in time.hidden else {}),
            }
            for axis in traffic
        },
        pipeline_bubble=time.bubble,
        step_time_s=time.step,
        mfu=time.model_flops / layout.world_size / (time.step * cluster.peak_tflops * 1e12),
        fits=memory.peak["total"] <= cluster.gpu_memory_gb * GB * (1 - training.headroom),
        num_microbatches=time.microbatches,
        flops_per_step=float(time.model_flops),
        params_total=params_total(config_key(config)),
        params_per_rank=memory.params_per_rank,
        params_active=config.active_params,
        activation_bytes_per_layer=memory.activation_bytes_per_layer,
        pipeline_schedule=settings.pipeline_schedule if layout.pp > 1 else None,
    )


def planned_layout(layout: Layout, settings: Parallelism) -> dict[str, int]:
    """The sizes and settings a plan reports under ``layout`` (``data_parallel_size``: one island's replicas)."""
    islands = {"islands": layout.islands, "sync_every": settings.sync_every} if layout.islands > 1 else {}
    return {
        "data_parallel_size": layout.dp,
        "tensor_parallel_size": layout.tp,
        "pipeline_parallel_size": layout.pp,
        "zero_stage": settings.zero_stage,
        "virtual_pipeline_size": settings.chunks_per_rank if layout.pp > 1 else 1,
        "expert_parallel_size": layout.ep,
        "context_parallel_size": layout.cp,
        **islands,
    }


def sizes_of(layout: Layout) -> dict[str, int]:
    """The `Parallelism` sizes of ``layout`` (``data_parallel_size``: the replicas of every island)."""
    return {
        "data_parallel_size": layout.data_replicas,
        "tensor_parallel_size": layout.tp,
        "pipeline_parallel_size": layout.pp,
        "expert_parallel_size": layout.ep,
        "context_parallel_size": layout.cp,
        "islands": layout.islands,
    }


def link_speeds(cluster: Cluster, layout: Layout) -> dict[str, float]:
    """GB/s per GPU of the link each axis's traffic crosses: NVLink while its group stays inside a node (TP: while its
    size divides a node's GPUs), else the network; DiLoCo's islands, the link between them."""
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    spans = {"tp": tp, "cp": tp * cp, "dp": tp * cp * dp, "pp": layout.island_size, "ep": tp * cp * layout.ep}
    links = {
        axis: cluster.intra_node_gbps if span <= cluster.gpus_per_node else cluster.inter_node_gbps
        for axis, span in spans.items()
    }
    links["tp"] = cluster.intra_node_gbps if cluster.gpus_per_node % tp == 0 else cluster.inter_node_gbps
    if layout.islands > 1:  # DiLoCo's outer step crosses the link between islands
        links["island"] = cluster.inter_island_gbps
    return links


def latencies(cluster: Cluster, links: dict[str, float], counts: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Seconds of latency per axis and step: NCCL's base latency per collective and its latency per ring hop on the
    axis's link (`traffic.collectives` counts both)."""
    latency = {}
    for axis, (n, hops) in counts.items():
        if axis == "island":
            latency[axis] = n * cluster.collective_latency_us * 1e-6 + hops * cluster.inter_island_latency_ms * 1e-3
            continue
        hop = cluster.intra_node_hop_us if links[axis] == cluster.intra_node_gbps else cluster.inter_node_hop_us
        latency[axis] = (n * cluster.collective_latency_us + hops * hop) * 1e-6
    return latency


@dataclass(frozen=True)
class StepTime:
    step: float  # seconds per optimizer step
    bubble: float  # the pipeline's idle share
    microbatches: int  # of one pipeline schedule
    model_flops: float  # of one optimizer step, all GPUs (recompute not counted)
    hidden: dict[str, float]  # seconds of each axis's traffic hidden behind compute (the CP ring's, by attention)


def step_time(
    config: GPTConfig,
    cluster: Cluster,
    layout: Layout,
    training: Training,
    settings: Parallelism,
    seconds: dict[str, float],
) -> StepTime:
    """A roofline: matmuls at ``training.efficiency`` of the peak, TP, PP, EP and the CP ring's unhidden part exposed,
    the whole stretched by the bubble, DP traffic hidden behind backward where it fits, DiLoCo's outer step on top."""
    s, pp = training.seq_len, layout.pp
    microbatches = training.global_batch_size // (layout.data_replicas * training.micro_batch_size)  # per replica
    schedule_m = microbatches // training.schedules_per_step(pp)  # micro-batches of one pipeline schedule
    # Compute: model FLOPs per token (6 per weight of every matmul, plus attention), recompute on top with AC.
    model_flops = config.flops_per_token(s) * training.global_batch_size * s
    full_recompute = settings.activation_checkpointing in (True, "full")
    hardware_flops = model_flops * (8 / 6 if full_recompute else 1.0)
    compute = (
        hardware_flops / cluster.gpus_per_node / cluster.nodes / (cluster.peak_tflops * 1e12 * training.efficiency)
    )
    compute *= cluster.gpus / layout.world_size  # the layout may use fewer GPUs than the cluster has
    costs = Costs.of(settings.activation_checkpointing)
    virtual = settings.chunks_per_rank if pp > 1 else 1
    bubble = bubble_theory(settings.pipeline_schedule, pp, schedule_m, virtual, costs) if pp > 1 else 0.0
    overlap = compute if settings.zero_stage == 3 else compute * 2 / 3  # DP traffic hides behind backward
    # The ring's next K/V block travels while attention computes on this one: it hides behind attention only.
    attention = compute * config.attention_flops_per_token(s) / config.flops_per_token(s)
    hidden = {"cp": min(seconds["cp"], attention)}
    exposed = compute + seconds["tp"] + seconds["pp"] + seconds["ep"] + seconds["cp"] - hidden["cp"]
    # NOTE: the outer step waits for its all-reduce (nothing computes meanwhile): amortised over its inner steps.
    step = exposed / (1 - bubble) + max(0.0, seconds["dp"] - overlap) + seconds.get("island", 0.0)
    return StepTime(step, bubble, schedule_m, model_flops, hidden)
