"""The pipeline schedule and micro-batch count of a layout, chosen by the planner.

Every schedule of `lit3d.parallel.schedules` is estimated with the most micro-batches per schedule that it runs and
that fit in memory (the global batch over the replicas and the micro-batch size, or a half, a quarter, ... of it with
gradient accumulation running the schedule again). More micro-batches shrink every bubble; only GPipe's memory grows
with them. The fastest that fits wins; each candidate's bubble, step time and activations go into the plan.
"""

from __future__ import annotations

from dataclasses import replace

from lit3d.models.config import GPTConfig
from lit3d.parallel.layout import Layout, check_model_fits_pipeline
from lit3d.parallel.schedules import SCHEDULES, last_stage_in_flight, microbatch_problem, peak_in_flight
from lit3d.parallel.settings import Parallelism
from lit3d.planner.estimate import GB, Cluster, Plan, Training, estimate

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
    fastest), its plan carrying every candidate's bubble; None if none can run. ``settings.num_microbatches``, when
    set, fixes the micro-batches per schedule."""
    per_replica = training.global_batch_size // (layout.data_replicas * training.micro_batch_size)
    tried = {}  # (schedule, chunks): the most micro-batches that fit, else the fewest tried
    for name, virtual in schedules:
        try:
            check_model_fits_pipeline(config, layout.pp, virtual)
            # (a `Parallelism` checks itself: the schedule composes with the ZeRO stage, runs these micro-batches)
            schedule = replace(settings, pipeline_schedule=name, virtual_pipeline_size=virtual).at(layout)
        except ValueError:
            continue
        held = None  # activations in flight of the last micro-batch count that did not fit
        for accumulate in _accumulations(per_replica, settings.num_microbatches):
            m = per_replica // accumulate
            if microbatch_problem(layout.pp, name, m) or _in_flight(name, layout.pp, m, virtual) == held:
                continue  # (fewer micro-batches that hold as much do not fit either)
            held = _in_flight(name, layout.pp, m, virtual)
            option = replace(training, accumulate_grad_batches=accumulate)
            tried[name, virtual] = option, schedule, estimate(config, cluster, layout, option, schedule)
            if tried[name, virtual][2].fits:  # fewer micro-batches would only idle more
                break
    if not tried:
        return None
    fitting = [option for option in tried.values() if option[2].fits] or list(tried.values())
    best = min(fitting, key=lambda c: (round(c[2].step_time_s, 6), c[2].memory_per_gpu["total"]))
    best[2].schedule_candidates = [_summary(*option) for option in tried.values()]
    return best


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


def _in_flight(schedule: str, pp: int, m: int, virtual: int) -> tuple[float, int]:
    peak = max(peak_in_flight(schedule, pp, m, virtual, rank) for rank in range(pp))
    return peak, last_stage_in_flight(schedule, pp, m)


def _summary(training: Training, settings: Parallelism, plan: Plan) -> dict:
    return {
        "pipeline_schedule": settings.pipeline_schedule,
        "virtual_pipeline_size": settings.chunks_per_rank,
        "num_microbatches": plan.num_microbatches,
        "accumulate_grad_batches": training.accumulate_grad_batches,
        "bubble": plan.pipeline_bubble,
        "step_time_s": plan.step_time_s,
        "activations_bytes": plan.memory_per_gpu["activations"],
        "fits": plan.fits,
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
