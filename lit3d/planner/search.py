"""The layout search: every valid (dp, cp, tp, pp, ZeRO, checkpointing) on a cluster, the ones that fit, fastest
first.

A layout is valid when tensor parallelism stays inside a node and divides the heads, kv heads, MLP width and
(padded) vocabulary; the pipeline has at least one block per chunk (and an untied head); the global batch
splits into whole micro-batches per replica that the schedule can run; context parallelism splits sequences of
`LONG_SEQUENCE` tokens or more into two equal chunks per rank. With a pipeline, each layout runs the schedule and
micro-batch count that give it the shortest step and fit (`lit3d.planner.pipeline`). Those that do not fit in memory
are dropped; the rest are ranked by estimated step time, then by data-parallel traffic and memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from lit3d.models.config import GPTConfig
from lit3d.parallel.context import check_context_parallel
from lit3d.parallel.layout import (
    ZERO_STAGES,
    Layout,
    check_model_fits_layout,
    check_model_fits_pipeline,
)
from lit3d.parallel.precision import check_float8
from lit3d.parallel.schedules import check_composes, microbatch_problem
from lit3d.parallel.settings import Parallelism
from lit3d.parallel.stages import check_stage_layers
from lit3d.parallel.zero import ZeroPolicy
from lit3d.planner.clock import largest_costs
from lit3d.planner.estimate import (
    GB,
    PLANNING_DEFAULTS,
    Case,
    Cluster,
    Plan,
    Ranks,
    Training,
    estimate,
    fits,
    may_fit,
    memory_by_stage,
    price,
)
from lit3d.planner.hsdp import check_groups_split_gpus, data_parallel_bytes, ranking_times, shard_groups
from lit3d.planner.pipeline import CANDIDATES, weigh_schedules, why_schedule

LONG_SEQUENCE = 16384  # tokens from which the search tries context parallelism
MIN_CP_CHUNK = 2048  # tokens a CP rank keeps at least (shorter shares leave the ring's hops exposed)


@dataclass
class Candidate:
    """A planned layout: its rank grid, the training loop's numbers and the run's settings it was estimated with (their
    sizes the layout's: what `lit3d.strategies.Parallel3DStrategy` would be built from), and the estimate."""

    layout: Layout
    training: Training
    parallelism: Parallelism
    plan: Plan

    def settings_to_run(self) -> Parallelism:
        """The strategy's settings that run this layout as planned (``Parallel3DStrategy.of(...)``): the planned ones,
        a pipeline's micro-batches per schedule fixed to the plan's (else the strategy chooses its own from the
        batch, and the run would not be the one planned)."""
        if self.layout.pp == 1:
            return self.parallelism
        return replace(self.parallelism, num_microbatches=self.plan.num_microbatches)


def layout_problem(
    config: GPTConfig,
    cluster: Cluster,
    layout: Layout,
    training: Training,
    settings: Parallelism = PLANNING_DEFAULTS,
) -> str | None:
    """Why ``layout`` cannot run ``config`` with ``training`` and ``settings`` (its sizes are ``layout``'s) on
    ``cluster`` (None if it can)."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    if layout.world_size > cluster.gpus:
        cp = f" x context_parallel_size={layout.cp}" if layout.cp > 1 else ""
        return (
            f"data_parallel_size={dp} x tensor_parallel_size={tp} x pipeline_parallel_size={pp}{cp} = "
            f"{layout.world_size} GPUs, but the cluster has {cluster.nodes} x {cluster.gpus_per_node} = "
            f"{cluster.gpus}"
        )
    virtual = settings.chunks_per_rank if pp > 1 else 1
    try:
        check_model_fits_layout(config, layout)
        check_model_fits_pipeline(config, pp, virtual)
        check_composes(settings.pipeline_schedule, pp, settings.compile, settings.zero_stage)
        sp = settings.sequence_parallel and tp > 1
        check_context_parallel(layout.cp, training.seq_len, tp, sp)
        check_float8(settings.float8, training.precision, config, tp, training.lora is not None)
        check_stage_layers(settings.pipeline_stage_layers, config.n_layer, pp * virtual)
    except ValueError as error:
        return str(error)
    per_step = layout.data_replicas * training.micro_batch_size
    if training.global_batch_size % per_step:
        return (
            f"global_batch_size={training.global_batch_size} is not divisible by data_parallel_size="
            f"{layout.data_replicas} x micro_batch_size={training.micro_batch_size}"
        )
    if pp > 1:  # the micro-batches of one schedule (gradient accumulation runs it again)
        m = training.global_batch_size // per_step // training.accumulate_grad_batches
        return microbatch_problem(pp, settings.pipeline_schedule, m)
    return None


def _pp_and_ep(config: GPTConfig, ranks: int, pps: list[int], ep: int | None) -> list[tuple[int, int]]:
    """Pipeline and expert-parallel sizes to try over ``ranks`` (what TP leaves): a dense model no EP, an MoE model
    every EP that divides both the DP ranks and the experts."""
    if not config.n_expert:
        return [(pp, 1) for pp in pps]
    eps = [ep] if ep else [e for e in divisors(ranks) if config.n_expert % e == 0]
    return [(pp, e) for pp in pps for e in eps if ranks % pp == 0 and (ranks // pp) % e == 0]


def context_parallel_sizes(training: Training, ranks: int, cp: int | None) -> list[int]:
    """CP sizes to try over ``ranks``: the one given, else 1, and for a long sequence every power of two that
    leaves each rank two equal chunks of at least `MIN_CP_CHUNK` tokens in all."""
    if cp:
        return [cp]
    s, sizes = training.seq_len, [1]
    while s >= LONG_SEQUENCE and s % (4 * sizes[-1]) == 0 and s // (2 * sizes[-1]) >= MIN_CP_CHUNK:
        sizes.append(2 * sizes[-1])
    return [c for c in sizes if ranks % c == 0]


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def search(
    config: GPTConfig,
    cluster: Cluster,
    training: Training,
    settings: Parallelism = PLANNING_DEFAULTS,
    *,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
    data_parallel_size: int | None = None,
    expert_parallel_size: int | None = None,
    context_parallel_size: int | None = None,
    zero_stages: tuple[int, ...] = ZERO_STAGES,
    checkpointing: tuple[bool | str, ...] = (False, True),
    pipeline_schedules: list[tuple[str, int]] | None = None,
    misses: list[Candidate] | None = None,
) -> tuple[list[Candidate], dict[str, int]]:
    """Layouts using every GPU of ``cluster`` (sizes given are kept), estimated with ``settings`` (the sizes, ZeRO
    stage, recompute and pipeline schedule replaced by each candidate's); returns those that fit, best first, and
    counts of what was dropped and why.

    An MoE model is searched over expert parallelism too, a long sequence over context parallelism. With DiLoCo's
    ``settings.islands``, each island gets ``1/islands`` of the GPUs and the same layout (``data_parallel_size`` then
    counts the replicas of one island). A pipelined layout runs the fastest of ``pipeline_schedules`` (``(schedule,
    chunks per rank)``; default: every one of `lit3d.planner.pipeline.CANDIDATES`) that fits. ``misses``, if given,
    collects the layouts dropped for memory."""
    check_groups_split_gpus(settings.data_parallel_shard_size, cluster.gpus // settings.islands)
    dropped = {"invalid": 0, "out_of_memory": 0}
    # NOTE: GPipe runs any micro-batch count on one chunk: the layout check leaves the schedules to `choose_schedule`.
    any_schedule = replace(settings, pipeline_schedule="gpipe", virtual_pipeline_size=None)
    fixed = (tensor_parallel_size, pipeline_parallel_size, expert_parallel_size, context_parallel_size)
    fitting: list[Candidate] = []
    unfit: list[Candidate | Callable[[], Candidate]] = []  # (planned only if no layout fits, for ``misses``)
    for layout in _layouts(config, cluster, training, settings.islands, *fixed):
        if data_parallel_size and data_parallel_size != layout.dp:
            continue
        if layout.world_size != cluster.gpus or layout_problem(config, cluster, layout, training, any_schedule):
            dropped["invalid"] += 1
            continue
        for zero, grouped, ac in _options(layout, settings.data_parallel_shard_size, zero_stages, checkpointing):
            option = _weighed(config, cluster, grouped, training, settings, zero, ac, pipeline_schedules)
            if option is None:  # no schedule runs the micro-batches there are (or the settings cannot compose)
                dropped["invalid"] += 1
            elif isinstance(option, Candidate) and option.plan.fits:
                fitting.append(option)
            else:
                dropped["out_of_memory"] += 1
                unfit.append(option)
    if misses is not None and not fitting:
        misses += [option if isinstance(option, Candidate) else option() for option in unfit]
    # Fastest first (HSDP's groups where they pay); among equals, the least data-parallel traffic, then memory.
    ranked = ranking_times(fitting)
    fitting.sort(
        key=lambda c: (
            round(ranked[id(c)], 6),
            c.layout.dp_shard is not None,
            data_parallel_bytes(c.plan),
            c.plan.memory_per_gpu["total"],
        )
    )
    return fitting, dropped


def _options(
    layout: Layout, shard: int | None, zero_stages: tuple[int, ...], checkpointing: tuple
) -> list[tuple[int, Layout, bool | str]]:
    """(ZeRO stage, the layout with its HSDP shard groups, recompute) to estimate: ZeRO only with replicas; shard
    groups of the size given, else one group of every replica and, where they split them, groups of a node's ranks,
    two nodes', four nodes', ..."""
    options = []
    for zero in zero_stages if layout.replicas > 1 else zero_stages[:1]:
        for grouped in shard_groups(layout, shard) if zero > 0 else [layout]:
            options += [(zero, grouped, ac) for ac in checkpointing]
    return options


def _layouts(
    config: GPTConfig, cluster: Cluster, training: Training, islands: int, tp: int | None, pp: int | None,
    ep: int | None, cp: int | None,
) -> list[Layout]:  # fmt: skip
    """Every (tp, cp, pp, ep) over one island's GPUs, the sizes given kept (DiLoCo's islands: neither EP nor CP)."""
    gpus = cluster.gpus // islands  # of one island
    shapes = [
        (t, c, p, e)
        for t in ([tp] if tp else divisors(cluster.gpus_per_node))
        for c in context_parallel_sizes(training, gpus // t, cp)
        for p, e in _pp_and_ep(config, gpus // (t * c), [pp] if pp else divisors(gpus // (t * c)), ep)
    ]
    return [
        Layout(dp=gpus // (t * p * c), tp=t, pp=p, devices_per_node=cluster.gpus_per_node, ep=e, cp=c, islands=islands)
        for t, c, p, e in shapes
        if islands == 1 or e == c == 1
    ]


def estimated(
    config: GPTConfig,
    cluster: Cluster,
    layout: Layout,
    training: Training,
    settings: Parallelism,
    zero_stage: int,
    checkpointing: bool | str,
    schedules: list[tuple[str, int]] | None,
) -> Candidate | None:
    """``layout`` run with ``settings`` at this ZeRO stage and recompute (and, pipelined, its fastest schedule that
    fits); None if none can run."""
    option = _weighed(config, cluster, layout, training, settings, zero_stage, checkpointing, schedules)
    return option() if callable(option) else option


def _weighed(
    config: GPTConfig,
    cluster: Cluster,
    layout: Layout,
    training: Training,
    settings: Parallelism,
    zero_stage: int,
    checkpointing: bool | str,
    schedules: list[tuple[str, int]] | None,
) -> Candidate | Callable[[], Candidate] | None:
    """`estimated`, planned only where it may fit: where its memory fits no schedule (nor the micro-steps' unsharded
    gradients), the call that plans it (which the search makes only for ``misses``, when no layout fits)."""
    try:
        option = replace(settings, zero_stage=zero_stage, activation_checkpointing=checkpointing).at(layout)
    except ValueError:  # e.g. a schedule given that this ZeRO stage cannot run
        return None
    if layout.pp > 1:
        weighed = weigh_schedules(config, cluster, layout, training, option, schedules or list(CANDIDATES))
        if weighed is None:
            return None
        candidate = lambda: Candidate(layout, *weighed.chosen())
        return candidate() if weighed.fits else candidate
    case = Case(config, cluster, layout, training, option)
    ranks = Ranks(case, case.chunks)
    memory = memory_by_stage(case, ranks.held)
    candidate = lambda: _accumulation(config, cluster, Candidate(layout, training, option, price(case, ranks, memory)))
    if fits(memory.by_stage, cluster, training):
        return candidate()
    # The gradients unsharded across the micro-steps, where the shards do not fit: they may fit where the ranks'
    # states and buffers alone do (`may_fit`: their least peak is the shards', which summing whole gradients leaves)
    unsharded = _unsharded(layout, training, option) if may_fit(ranks.held, cluster, training) else None
    alternative = memory_by_stage(Case(config, cluster, layout, training, unsharded)) if unsharded else None
    return candidate() if alternative and fits(alternative.by_stage, cluster, training) else candidate


def _accumulation(config: GPTConfig, cluster: Cluster, candidate: Candidate) -> Candidate:
    """ZeRO-2/3 with gradient accumulation: the candidate that keeps the gradients unsharded across the micro-steps
    (one reduce-scatter per step) where it fits and is faster, else the sharded one (one per micro-step)."""
    layout, training = candidate.layout, candidate.training
    unsharded = _unsharded(layout, training, candidate.parallelism)
    if unsharded is None:
        return candidate
    plan = estimate(config, cluster, layout, training, unsharded)
    if plan.fits and plan.step_time_s < candidate.plan.step_time_s:
        return Candidate(layout, training, unsharded, plan)
    return candidate


def _unsharded(layout: Layout, training: Training, settings: Parallelism) -> Parallelism | None:
    """``settings`` keeping ZeRO-2/3's gradients unsharded across the micro-steps, where it reduces them at each of
    several (None elsewhere)."""
    micro_steps = training.global_batch_size // (layout.data_replicas * training.micro_batch_size)
    if not ZeroPolicy.of(settings, layout).reduces_every_micro_step or layout.replicas == 1 or micro_steps == 1:
        return None
    return replace(settings, accumulate_unsharded=True)


def why(candidate: Candidate, cluster: Cluster) -> str:
    """One line on what makes this layout good (or what it pays for)."""
    plan, layout, training, settings = candidate.plan, candidate.layout, candidate.training, candidate.parallelism
    usable = cluster.gpu_memory_gb * (1 - training.headroom)
    total = _gb(plan.memory_per_gpu["total"] / GB)
    parts = [f"{total} of {usable:.0f} GB usable" if usable >= 1 else f"{total} of {usable:.3g} GB usable"]
    if layout.tp > 1:
        link = "NVLink" if cluster.gpus_per_node % layout.tp == 0 else "crosses nodes"
        parts.append(
            f"TP{layout.tp} inside a node ({link}), {plan.communication_per_step['tp']['seconds']:.2f} s exposed"
        )
    if layout.pp > 1:
        parts.append(f"PP{layout.pp} with {plan.num_microbatches} micro-batches")
        if plan.schedule_candidates:
            parts[-1] += f", {why_schedule(plan)}"
        else:
            parts[-1] += f", bubble {plan.pipeline_bubble:.1%}"
    if layout.ep > 1:
        ep = plan.communication_per_step["ep"]
        parts.append(
            f"EP{layout.ep} holds 1/{layout.ep} of the experts per rank, all-to-alls move {_gb(ep['bytes'] / GB)} "
            f"GB/GPU in {ep['seconds']:.2f} s"
        )
    if layout.cp > 1:
        cp = plan.communication_per_step["cp"]
        parts.append(
            f"CP{layout.cp} keeps {training.seq_len // layout.cp:,} of {training.seq_len:,} tokens per rank, its ring "
            f"moves {_gb(cp['bytes'] / GB)} GB/GPU in {cp['seconds']:.2f} s, {cp['hidden_s']:.2f} s hidden by attention"
        )
    if layout.replicas > 1:
        parts.append(_replicas_why(plan, layout, settings))
    if settings.accumulate_unsharded:
        parts.append("gradients unsharded across the micro-steps (one reduce-scatter per step)")
    if settings.activation_checkpointing:
        policy = "selective" if settings.activation_checkpointing == "selective" else "full"
        parts.append(f"recomputes activations ({policy})")
    parts.append(f"time: {largest_costs(plan.time_breakdown, plan.step_time_s)}")
    return "; ".join(parts)


def _replicas_why(plan: Plan, layout: Layout, settings: Parallelism) -> str:
    """What keeping the replicas in sync costs; with HSDP's shard groups, within a group and across them."""
    comm = plan.communication_per_step
    replicas = f"DP{layout.dp}" + (f" x CP{layout.cp}" if layout.cp > 1 else "")
    if "dp" in comm:
        dp = comm["dp"]
        return f"{replicas} ZeRO-{settings.zero_stage} moves {_gb(dp['bytes'] / GB)} GB/GPU in {dp['seconds']:.2f} s"
    shard, across = comm["dp_shard"], comm["dp_replicate"]
    return (
        f"{replicas} ZeRO-{settings.zero_stage} in {layout.dp_replicate} shard groups of {layout.shard_size} (HSDP): "
        f"{_gb(shard['bytes'] / GB)} GB/GPU within a group over {shard['link_gbps']:.0f} GB/s in "
        f"{shard['seconds']:.2f} s, {_gb(across['bytes'] / GB)} GB/GPU across groups over "
        f"{across['link_gbps']:.0f} GB/s in {across['seconds']:.2f} s"
    )


def _gb(value: float) -> str:
    """GB as the reports write them: one decimal, or three digits below a tenth (a rehearsal's tiny numbers)."""
    return f"{value:.1f}" if value >= 0.05 or value == 0 else f"{value:.3g}"


def tokens_per_second(plan: Plan, training: Training) -> float:
    return training.global_batch_size * training.seq_len / plan.step_time_s if math.isfinite(plan.step_time_s) else 0.0
