"""Plans for a fleet: one job over node groups of different GPU kinds (``lit3d plan --fleet 2x8xH100,6x8xA100``).

A fleet is a list of `Cluster`s, one per node group, in the order of the job's node ranks. Three ways to use it are
priced, each with the planner's own clock, and the fastest that fits is chosen:

- ``pipeline``: the depth split over every group (pipeline stages never share a group's GPUs with another kind; TP
  stays inside a node), each stage of a group as many blocks as its GPUs' speed earns (`pipeline_stage_layers`);
  the stages are priced on their own GPUs (`Cluster.stage_gpus`).
- ``data``: one data-parallel replica per ``tp`` GPUs, the replicas of faster GPUs computing more of each global
  batch (`data_parallel_shares`, whole micro-batches, the same gradient accumulation on all); each group is priced
  running its largest share. Only without a pipeline: a replica's stages would span groups.
- ``islands``: one DiLoCo island per group, when the groups have as many GPUs (islands are equal layouts); the
  islands then wait for the slowest at each outer step, so it is priced as the slowest kind.

Beside them, the two runs a user has without a fleet plan: the fastest group alone, and every GPU as the slowest
kind (an even split paced by the slowest GPU). Links between groups are priced at the slowest group's links.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from itertools import product
from typing import Any

from lit3d.models.config import GPTConfig
from lit3d.parallel.layout import ZERO_STAGES, Layout
from lit3d.parallel.stages import partition
from lit3d.planner.clock import stage_times
from lit3d.planner.estimate import GB, Cluster, Training, estimate
from lit3d.planner.hardware import GPU, GPUS
from lit3d.planner.request import DILOCO_SYNC_EVERY, Request, plan
from lit3d.planner.search import Candidate, divisors, estimated, layout_problem
from lit3d.planner.shapes import block_costs

FLEET_FORMAT = "NODESxGPUSxKIND"  # one node group: 2x8xH100
# Settings the fleet plan chooses itself; given, they are refused (plan a single kind with them instead).
CHOSEN_BY_FLEET = (
    "pipeline_parallel_size",
    "data_parallel_size",
    "expert_parallel_size",
    "context_parallel_size",
    "pipeline_stage_layers",
    "data_parallel_shares",
    "islands",
    "virtual_pipeline_size",
    "num_microbatches",
)
ONE_CHUNK = [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1)]  # the schedules uneven stages are planned with


def parse_fleet(text: str, **numbers: Any) -> list[Cluster]:
    """The node groups of ``2x8xH100,6x8xA100`` (nodes x GPUs per node x a known GPU), each a `Cluster` of that
    GPU (``numbers``: `Cluster` fields every group shares, e.g. the link between islands). Refused in one line."""
    groups = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)x(\d+)x(.+?)\s*", part)
        if not match:
            raise ValueError(f"fleet={text!r}: {part!r} is not {FLEET_FORMAT} (e.g. 2x8xH100)")
        nodes, per_node, kind = int(match[1]), int(match[2]), match[3]
        if kind not in GPUS:
            raise ValueError(f"fleet={text!r}: unknown GPU {kind!r} (known: {', '.join(GPUS)})")
        if nodes < 1 or per_node < 1:
            raise ValueError(f"fleet={text!r}: {part!r} needs at least one node of at least one GPU")
        groups.append(Cluster.of(GPUS[kind], nodes, per_node, **numbers))
    check_fleet(groups)
    return groups


def check_fleet(groups: list[Cluster]) -> None:
    """Two groups or more, each node with as many GPUs (Lightning's ``devices`` is one number for every node)."""
    if len(groups) < 2:
        raise ValueError(f"a fleet has two node groups or more, got {len(groups)}: plan one kind with --nodes, --gpu")
    per_node = sorted({g.gpus_per_node for g in groups})
    if len(per_node) > 1:
        raise ValueError(f"fleet groups have {per_node} GPUs per node: one job runs as many on every node")


def speed(gpu: GPU) -> float:
    """What a GPU's matmuls reach, FLOP/s: the weight its stages and shares get."""
    return gpu.peak_tflops * 1e12 * gpu.efficiency.gemm


def shared_cluster(groups: list[Cluster]) -> Cluster:
    """All the fleet's nodes as one cluster of the slowest kind, with the least memory of the fleet and the slowest
    group's links: what an even split, and the links between groups, are priced with."""
    slowest = replace(min((g.gpu for g in groups), key=speed), memory_gb=min(g.gpu_memory_gb for g in groups))
    links = {name: min(getattr(g, name) for g in groups) for name in ("intra_node_gbps", "inter_node_gbps")}
    return replace(
        groups[0],
        nodes=sum(g.nodes for g in groups),
        gpu=slowest,
        peak_tflops=slowest.peak_tflops,
        gpu_memory_gb=slowest.memory_gb,
        device="GPU",
        **links,
    )


@dataclass
class Option:
    """One way to run the fleet: ``kind`` (``pipeline``, ``data``, ``islands``, or a baseline), the layout as the
    strategy runs it (``candidate``; None if nothing fits, ``note`` says why), and each group's part."""

    kind: str
    candidate: Candidate | None
    parts: list[dict[str, Any]]
    note: str = ""

    @property
    def step_time_s(self) -> float:
        return self.candidate.plan.step_time_s if self.candidate else math.inf


def pipeline_option(config: GPTConfig, groups: list[Cluster], request: Request) -> Option:
    """The fastest uneven pipeline over the fleet: every TP and DP size every group divides, stages by speed."""
    base, best = shared_cluster(groups), None
    zeros, recompute = _zero_and_recompute(request)
    for tp in _tensor_sizes(groups, request):
        for dp in divisors(math.gcd(*(g.gpus // tp for g in groups))):
            cluster = pipeline_cluster(base, groups, dp * tp)
            if len(cluster.stage_gpus) > config.n_layer:
                continue
            layout = Layout(dp=dp, tp=tp, pp=len(cluster.stage_gpus), devices_per_node=base.gpus_per_node)
            even = replace(request.parallelism, pipeline_schedule="gpipe", virtual_pipeline_size=None).at(layout)
            for layers in stage_splits(config, cluster, layout, request.training, even):
                settings = replace(even, pipeline_stage_layers=layers)
                if layout_problem(config, cluster, layout, request.training, settings):
                    continue
                # (one replica: every ZeRO stage holds the same)
                for zero, ac in product(zeros if dp > 1 else zeros[:1], recompute):
                    option = estimated(
                        config, cluster, layout, request.training, settings, zero, ac, _schedules(request)
                    )
                    best = _faster(best, option)
    if best is None:
        return Option("pipeline", None, [], "no pipeline over the groups runs this model and batch")
    parts = _stage_parts(config, groups, best, pipeline_cluster(base, groups, best.layout.dp * best.layout.tp))
    return Option("pipeline", best, parts, "" if best.plan.fits else "does not fit")


def pipeline_cluster(base: Cluster, groups: list[Cluster], per_stage: int) -> Cluster:
    """``base`` with a pipeline stage per ``per_stage`` GPUs of each group, in order, each stage on its group's GPU."""
    return replace(base, stage_gpus=tuple(g.gpu for g in groups for _ in range(g.gpus // per_stage)))


def stage_splits(
    config: GPTConfig, cluster: Cluster, layout: Layout, training: Training, settings: Any
) -> list[tuple[int, ...]]:
    """Blocks per stage to try: cut by cost over each stage's speed, first as its GPU's matmuls promise (`speed`),
    then as the clock prices that cut's stages (a second cut, and one halfway to even), and even by cost (which
    holds least on a smaller memory)."""
    costs, first, last = block_costs(config)
    promised = [speed(g) for g in cluster.stage_gpus]
    cut = _cut(costs, first, last, promised)
    times = stage_times(config, cluster, layout, training, replace(settings, pipeline_stage_layers=cut))
    priced = [n / t for n, t in zip(cut, times)]  # blocks per second each stage's device runs
    splits = [
        cut,
        _cut(costs, first, last, priced),
        _cut(costs, first, last, [v**0.5 for v in priced]),
        _cut(costs, first, last, [1.0] * len(priced)),
    ]
    return list(dict.fromkeys(splits))


def _cut(costs: list[float], first: float, last: float, speeds: list[float]) -> tuple[int, ...]:
    return tuple(len(run) for run in partition(costs, first, last, len(speeds), speeds))


def data_option(config: GPTConfig, groups: list[Cluster], request: Request) -> Option:
    """The fastest uneven data parallelism over the fleet: a replica per ``tp`` GPUs, each group's share of every
    global batch by its speed, in whole micro-batches of the same gradient accumulation."""
    base, best, training = shared_cluster(groups), None, request.training
    zeros, recompute = _zero_and_recompute(request)
    batch = training.global_batch_size
    for tp in _tensor_sizes(groups, request):
        counts = [g.gpus // tp for g in groups]
        layout = Layout(dp=sum(counts), tp=tp, pp=1, devices_per_node=base.gpus_per_node)
        for accumulate in (a for a in divisors(batch) if batch // a >= layout.dp):
            micro = water_fill(batch // accumulate, [speed(g.gpu) for g, n in zip(groups, counts) for _ in range(n)])
            shares = tuple(m * accumulate for m in micro)
            for zero, ac in product(zeros, recompute):
                settings = replace(
                    request.parallelism, zero_stage=zero, activation_checkpointing=ac, data_parallel_shares=shares
                ).at(layout)
                option = replicas_option(config, groups, base, layout, training, settings, accumulate)
                if option and (best is None or _faster(best.candidate, option.candidate) is option.candidate):
                    best = option
    return best or Option("data", None, [], "no data-parallel split runs this model and batch")


def water_fill(units: int, speeds: list[float]) -> list[int]:
    """``units`` micro-batches over replicas of these ``speeds``, at least one each: each next one to the replica
    that would finish it soonest (the slowest replica's time as low as whole micro-batches allow)."""
    counts = [1] * len(speeds)
    for _ in range(units - len(speeds)):
        i = min(range(len(speeds)), key=lambda r: ((counts[r] + 1) / speeds[r], r))
        counts[i] += 1
    return counts


def replicas_option(
    config: GPTConfig,
    groups: list[Cluster],
    base: Cluster,
    layout: Layout,
    training: Training,
    settings: Any,
    accumulate: int,
) -> Option | None:
    """The data option of ``settings.data_parallel_shares``: each group priced as if every replica held its group's
    largest share (a micro-batch of it, ``accumulate`` times a step), the step the slowest group's."""
    shares, even = settings.data_parallel_shares, replace(settings, data_parallel_shares=None)
    priced, parts, start = [], [], 0
    for group in groups:
        count = group.gpus // layout.tp
        mine = list(shares[start : start + count])
        cluster = replace(
            base,
            gpu=group.gpu,
            peak_tflops=group.peak_tflops,
            gpu_memory_gb=group.gpu_memory_gb,
            intra_node_gbps=group.intra_node_gbps,
        )
        own = replace(training, micro_batch_size=max(mine) // accumulate, global_batch_size=max(mine) * layout.dp)
        if layout_problem(config, cluster, layout, own, even):
            return None
        group_plan = estimate(config, cluster, layout, own, even)
        priced.append((group_plan, own))
        part = _part(group, f"replicas {start}-{start + count - 1}", group_plan.memory_per_gpu["total"], training)
        parts.append(
            {
                **part,
                "step_s": group_plan.step_time_s,
                "replicas": list(range(start, start + count)),
                "data_parallel_shares": mine,
            }
        )
        start += count
    slowest, own = max(priced, key=lambda p: p[0].step_time_s)
    step, batch = slowest.step_time_s, training.global_batch_size
    flops = slowest.flops_per_step * batch / own.global_batch_size  # of the real global batch
    most = max((p for p, _ in priced), key=lambda p: p.memory_per_gpu["total"])
    combined = replace(
        slowest,
        fits=all(p.fits for p, _ in priced),
        memory_per_gpu=most.memory_per_gpu,
        memory_by_stage=most.memory_by_stage,
        flops_per_step=flops,
        mfu=flops / (step * sum(g.gpus * g.peak_tflops for g in groups) * 1e12),
        tokens_per_s_per_gpu=batch * training.seq_len / (step * layout.world_size),
    )
    ran = replace(training, micro_batch_size=min(shares) // accumulate, accumulate_grad_batches=accumulate)
    return Option("data", Candidate(layout, ran, settings, combined), parts, "" if combined.fits else "does not fit")


def islands_option(config: GPTConfig, groups: list[Cluster], request: Request) -> Option:
    """One DiLoCo island per group, when the groups have as many GPUs: the slowest kind's search with that many
    islands (each waits for the slowest at the outer step)."""
    sizes = sorted({g.gpus for g in groups})
    if len(sizes) > 1:
        return Option("islands", None, [], f"islands are equal layouts; the groups have {sizes} GPUs")
    settings = replace(request.parallelism, islands=len(groups), sync_every=_sync_every(request))
    given = replace(request, fixed=request.fixed | {"islands"}, parallelism=settings)  # (on the slowest kind)
    best = plan(given).chosen
    if best is None:
        return Option("islands", None, [], "no island layout fits")
    peak = sum(g.gpus * g.peak_tflops for g in groups) * 1e12  # (planned on the slowest kind: MFU of the fleet's peak)
    best.plan = replace(best.plan, mfu=best.plan.flops_per_step / (best.plan.step_time_s * peak))
    parts = [_part(g, f"island {i}", best.plan.memory_per_gpu["total"], best.training) for i, g in enumerate(groups)]
    return Option("islands", best, parts)


def fastest_group(groups: list[Cluster]) -> Cluster:
    return max(groups, key=lambda g: speed(g.gpu))


def baseline(cluster: Cluster, request: Request, kind: str) -> Option:
    """A plain search on ``cluster`` (the fastest group alone, or every GPU as the slowest kind)."""
    best = plan(replace(request, cluster=cluster)).chosen
    note = "" if best else f"nothing fits on {cluster.gpus} {cluster.gpu.name}"
    return Option(kind, best, [], note)


def _sync_every(request: Request) -> int:
    return request.parallelism.sync_every if "sync_every" in request.fixed else DILOCO_SYNC_EVERY


def _stage_parts(config: GPTConfig, groups: list[Cluster], best: Candidate, cluster: Cluster) -> list[dict[str, Any]]:
    """Each group's pipeline stages, their blocks, the most memory one of them holds and its slowest micro-batch."""
    layers, layout = best.parallelism.pipeline_stage_layers, best.layout
    times = stage_times(config, cluster, layout, best.training, best.parallelism)
    parts, first = [], 0
    for group in groups:
        stages = list(range(first, first + group.gpus // (layout.dp * layout.tp)))
        memory = max(best.plan.memory_by_stage[s]["total"] for s in stages)
        part = _part(group, f"stages {stages[0]}-{stages[-1]}", memory, best.training)
        parts.append(
            {
                **part,
                "micro_batch_s": max(times[s] for s in stages),
                "stages": stages,
                "pipeline_stage_layers": [layers[s] for s in stages],
            }
        )
        first += len(stages)
    return parts


def _part(group: Cluster, role: str, memory: float, training: Training) -> dict[str, Any]:
    usable = group.gpu_memory_gb * (1 - training.headroom)
    return {
        "gpu": group.gpu.name,
        "nodes": group.nodes,
        "gpus": group.gpus,
        "role": role,
        "memory_gb": round(memory / GB, 1),
        "usable_gb": round(usable, 1),
    }


def _tensor_sizes(groups: list[Cluster], request: Request) -> list[int]:
    fixed = request.fixed_value("tensor_parallel_size")
    return [fixed] if fixed else divisors(groups[0].gpus_per_node)


def _zero_and_recompute(request: Request) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    zero, ac = request.fixed_value("zero_stage"), request.fixed_value("activation_checkpointing")
    return (ZERO_STAGES if zero is None else (zero,)), ((False, True) if ac is None else (ac,))


def _schedules(request: Request) -> list[tuple[str, int]]:
    fixed = request.fixed_value("pipeline_schedule")
    return [(name, 1) for name, _ in ONE_CHUNK if fixed in (None, name)]


def _faster(best: Candidate | None, option: Candidate | None) -> Candidate | None:
    """The faster of two (one that fits before one that does not)."""
    if option is None:
        return best
    if best is None:
        return option
    return min(
        best, option, key=lambda c: (not c.plan.fits, round(c.plan.step_time_s, 6), c.plan.memory_per_gpu["total"])
    )
