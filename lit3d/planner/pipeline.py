"""The pipeline schedule and micro-batch count of a layout, chosen by the planner.

Every schedule of `lit3d.parallel.schedules` is estimated with the most micro-batches per schedule that it runs and
that fit in memory (the global batch over the replicas and the micro-batch size, or a half, a quarter, ... of it with
gradient accumulation running the schedule again). More micro-batches shrink every bubble; only GPipe's memory grows
with them. The fastest that fits wins; each candidate's bubble, step time and activations go into the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

from lit3d.models.config import GPTConfig
from lit3d.parallel.layout import Layout, check_model_fits_pipeline
from lit3d.parallel.schedules import SCHEDULES, check_composes, chunks_per_rank, microbatch_problem
from lit3d.parallel.settings import Parallelism
from lit3d.planner.estimate import (
    GB,
    Case,
    Cluster,
    Memory,
    Plan,
    Ranks,
    Training,
    fits,
    may_fit,
    memory_by_stage,
    price,
    timed,
)
from lit3d.planner.memory import Held

# (schedule, chunks per rank) the search tries: the interleaved and zero-bubble ones at two chunks (ZB-H1 at one).
CANDIDATES = (
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("zero_bubble", 1),
    ("zero_bubble", 2),
    ("zbv", 2),
    ("dualpipev", 2),
)
NAMES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "interleaved 1F1B",
    "zero_bubble": "ZB-H1",
    "zbv": "ZBV",
    "dualpipev": "DualPipe-V",
}


def candidates(schedule: str | None, virtual: int | None) -> list[tuple[str, int]]:
    """What to try: every candidate, or those of the one ``schedule`` asked for (at ``virtual`` chunks if given);
    ``virtual`` alone: the candidates of that many chunks per rank (else every schedule that runs any number)."""
    if schedule is None and virtual is None:
        return list(CANDIDATES)
    if schedule is None:
        same = [(name, chunks) for name, chunks in CANDIDATES if chunks == virtual]
        return same or [(name, virtual) for name, s in SCHEDULES.items() if s.chunks is None]
    fixed = SCHEDULES[schedule].chunks
    if virtual or fixed:
        return [(schedule, fixed or virtual)]
    return [(name, v) for name, v in CANDIDATES if name == schedule]


def choose_schedule(
    config: GPTConfig,
    cluster: Cluster,
    layout: Layout,
    training: Training,
    settings: Parallelism,
    schedules: list[tuple[str, int]],
) -> tuple[Training, Parallelism, Plan] | None:
    """The fastest of ``schedules`` (with their micro-batch counts) for ``layout`` that fits (if none does, the
    fastest), its plan carrying every candidate's bubble; None if none can run. ``settings``: at ``layout``'s sizes
    (`Parallelism.at`); its ``num_microbatches``, when set, fixes the micro-batches per schedule."""
    weighed = weigh_schedules(config, cluster, layout, training, settings, schedules)
    return None if weighed is None else weighed.chosen()


@dataclass(frozen=True)
class Weighed:
    """A layout's pipeline schedules weighed by their memory (`weigh_schedules`), each at the micro-batch count it
    runs, with what its ranks hold whatever the count (`Ranks`); each schedule's settings checked, and the schedules
    priced, when asked (`chosen`)."""

    option: Case  # the layout with its settings but for the schedule
    # (schedule, chunks per rank): its schedules per step, its memory (None where no count can fit, until priced), its
    # ranks, whether it fits
    weighed: dict[tuple[str, int], tuple[int, Memory | None, Ranks, bool]]
    checked: dict[tuple[str, int], Parallelism | None] = field(default_factory=dict, compare=False, repr=False)

    def settings(self, name: str, virtual: int) -> Parallelism | None:
        """The settings that run schedule ``name`` with ``virtual`` chunks per rank; None if they cannot (a
        `Parallelism` checks itself: the schedule composes with the ZeRO stage, runs these micro-batches)."""
        if (name, virtual) not in self.checked:
            try:
                run = replace(self.option.settings, pipeline_schedule=name, virtual_pipeline_size=virtual)
            except ValueError:
                run = None
            self.checked[name, virtual] = run
        return self.checked[name, virtual]

    @property
    def runs(self) -> bool:
        """Whether some schedule runs."""
        return any(self.settings(*schedule) is not None for schedule in self.weighed)

    @property
    def fits(self) -> bool:
        """Whether some schedule fits (and runs)."""
        return any(fitting and self.settings(*key) is not None for key, (*_, fitting) in self.weighed.items())

    def chosen(self) -> tuple[Training, Parallelism, Plan]:
        """`choose_schedule`'s answer: every schedule timed, the fastest that fits (if none does, the fastest)
        planned whole, its plan carrying every schedule's summary."""
        tried = []
        for (name, virtual), (accumulate, memory, ranks, _) in self.weighed.items():
            settings = self.settings(name, virtual)
            if settings is None:
                continue
            case = ranks.case.scheduled(settings, accumulate)
            memory = memory_by_stage(case, ranks.held) if memory is None else memory
            tried.append(
                _Tried(case, ranks, memory, timed(case, ranks), fits(memory.by_stage, case.cluster, case.training))
            )
        fitting = [option for option in tried if option.fits] or tried
        best = min(fitting, key=lambda c: (round(c.timing[0].step, 6), c.memory.peak["total"]))
        plan = price(best.case, best.ranks, best.memory, best.timing)
        plan.schedule_candidates = [_summary(option) for option in tried]
        return best.case.training, best.case.settings, plan


class _Tried(NamedTuple):
    """A schedule weighed and timed (`Weighed.chosen`)."""

    case: Case
    ranks: Ranks
    memory: Memory
    timing: tuple  # `timed`'s
    fits: bool


def weigh_schedules(
    config: GPTConfig,
    cluster: Cluster,
    layout: Layout,
    training: Training,
    settings: Parallelism,
    schedules: list[tuple[str, int]],
) -> Weighed | None:
    """Each of ``schedules`` at the most micro-batches that fit (else the fewest tried), by its memory alone; None if
    none can run. ``settings``: at ``layout``'s sizes (`Parallelism.at`). What the ranks hold and compute whatever
    the count (`Ranks`) is worked out once per chunks per rank and their placement, which schedules share; a
    schedule's settings are checked where it fits, or priced (`Weighed.settings`)."""
    found, ranks = Weighed(Case(config, cluster, layout, training, settings), {}), {}  # ranks: by chunks, placement
    for name, virtual in schedules:
        try:  # (what the schedule's settings would refuse first: `Weighed.settings` checks them all)
            check_model_fits_pipeline(config, layout.pp, virtual)
            check_composes(name, layout.pp, settings.compile, settings.zero_stage)
            chunks = (chunks_per_rank(name, virtual), SCHEDULES[name].placement)
        except ValueError:
            continue
        if chunks not in ranks:
            ranks[chunks] = Ranks(found.option, chunks)
        try:
            counted = _weigh(ranks[chunks], name, virtual, settings.num_microbatches)
        except ValueError:  # (stages these settings cannot cut: a schedule they cannot run)
            if found.settings(name, virtual) is None:
                continue
            raise
        if counted is not None:
            found.weighed[name, virtual] = *counted[:2], ranks[chunks], counted[2]
    return found if found.runs else None


def _weigh(ranks: Ranks, name: str, virtual: int, microbatches: int | None) -> tuple[int, Memory | None, bool] | None:
    """Schedule ``name`` (``virtual`` chunks per rank) on the layout of ``ranks`` at the most micro-batches that fit,
    else the fewest tried (``microbatches``: per schedule, if fixed): its schedules per step, its memory (None where
    none can fit, left to be worked out when priced) and whether it fits; None if it runs no count."""
    base, held = ranks.case, ranks.held
    cluster, layout, training = base.cluster, base.layout, base.training
    per_replica = training.global_batch_size // (layout.data_replicas * training.micro_batch_size)
    tried, peak = [], None  # (schedules per step, in flight on each rank, losses kept); peak: the last one's
    for accumulate in _accumulations(per_replica, microbatches):
        m = per_replica // accumulate
        if microbatch_problem(layout.pp, name, m):
            continue
        flights, losses = held.in_flight(name, m)
        if (max(flights), losses) == peak:
            continue  # (fewer micro-batches that hold as much do not fit either)
        peak = max(flights), losses
        tried.append((accumulate, flights, losses))
    if not tried:
        return None
    rows = None
    if _may_fit(held, tried, cluster, training):
        for accumulate, flights, losses in tried:
            rows = held.rows(flights, losses)
            if fits(rows, cluster, training):  # fewer micro-batches would only idle more
                return accumulate, held.memory(rows), True
    return tried[-1][0], None if rows is None else held.memory(rows), False


def _may_fit(
    held: Held, tried: list[tuple[int, tuple[float, ...], float]], cluster: Cluster, training: Training
) -> bool:
    """Whether any of the micro-batch counts ``tried`` may fit: no rank's states and buffers alone pass its memory
    (`may_fit`), nor its memory with the fewest micro-batches in flight and losses of any count (a lower bound, as
    activations grow with them: but for the first block's under LoRA, which keeps less with more)."""
    if not may_fit(held, cluster, training):
        return False
    if held.case.training.lora is not None and not held.case.settings.activation_checkpointing:
        return True
    fewest = tuple(min(rank) for rank in zip(*(flights for _, flights, _ in tried)))
    return fits(held.rows(fewest, min(losses for *_, losses in tried)), cluster, training)


def _accumulations(per_replica: int, microbatches: int | None) -> list[int]:
    """Schedules per step to try, fewest first: 1, 2, 4, ... dividing the per-replica batch (or the one that
    makes ``microbatches``)."""
    if microbatches is not None:
        return [per_replica // microbatches] if per_replica % microbatches == 0 else []
    out, accumulate = [], 1
    while accumulate <= per_replica:
        if per_replica % accumulate == 0:
            out.append(accumulate)
        accumulate *= 2
    return out


def _summary(tried: _Tried) -> dict:
    """A schedule weighed for a plan (`Plan.schedule_candidates`)."""
    case, time = tried.case, tried.timing[0]
    return {
        "pipeline_schedule": case.settings.pipeline_schedule,
        "virtual_pipeline_size": case.settings.chunks_per_rank,
        "num_microbatches": time.microbatches,
        "accumulate_grad_batches": case.training.accumulate_grad_batches,
        "bubble": time.bubble,
        "step_time_s": time.step,
        "activations_bytes": tried.memory.peak["activations"],
        "fits": tried.fits,
    }


def label(schedule: str, virtual: int) -> str:
    """``ZBV``, ``ZB-H1``, ``interleaved 1F1B v2``: a schedule as the reports name it."""
    if schedule == "zero_bubble" and virtual > 1:
        return f"zero bubble v{virtual}"
    return NAMES[schedule] + (f" v{virtual}" if schedule == "interleaved_1f1b" else "")


def why_schedule(plan: Plan) -> str:
    """``ZBV: bubble 2.0% against 1F1B 16.0%, +1.3 GB activations``: the chosen schedule against 1F1B (or, when 1F1B
    is chosen, against the runner-up)."""
    chosen = next(c for c in plan.schedule_candidates if same_schedule(c, plan))
    others = [c for c in plan.schedule_candidates if c["fits"] and not same_schedule(c, plan)]
    versus = next((c for c in others if c["pipeline_schedule"] == "1f1b"), None)
    versus = versus or min(others, key=lambda c: c["step_time_s"], default=None)
    text = f"{label(chosen['pipeline_schedule'], chosen['virtual_pipeline_size'])}: bubble {chosen['bubble']:.1%}"
    if versus is None:
        return text
    extra = (chosen["activations_bytes"] - versus["activations_bytes"]) / GB
    other = f"{label(versus['pipeline_schedule'], versus['virtual_pipeline_size'])} {versus['bubble']:.1%}"
    if versus["num_microbatches"] != chosen["num_microbatches"]:  # it fits only with fewer
        other += f" (m={versus['num_microbatches']})"
    return f"{text} against {other}, {extra:+.1f} GB activations"


def same_schedule(candidate: dict, plan: Plan) -> bool:
    chosen = (plan.pipeline_schedule, plan.layout["virtual_pipeline_size"])
    return (candidate["pipeline_schedule"], candidate["virtual_pipeline_size"]) == chosen


def schedule_flags(training: Training, settings: Parallelism, plan: Plan) -> str:
    """The command-line flags that run the schedule as planned: its name, micro-batches per schedule, chunks per
    rank, and the schedules per step (gradient accumulation)."""
    flags = (
        f" --trainer.strategy.pipeline_schedule={settings.pipeline_schedule}"
        f" --trainer.strategy.num_microbatches={plan.num_microbatches}"
    )
    if SCHEDULES[settings.pipeline_schedule].chunks is None and settings.chunks_per_rank > 1:
        flags += f" --trainer.strategy.virtual_pipeline_size={settings.chunks_per_rank}"
    if training.accumulate_grad_batches > 1:
        flags += f" --trainer.accumulate_grad_batches={training.accumulate_grad_batches}"
    return flags
