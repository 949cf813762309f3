"""HSDP in the search: the shard-group sizes it tries, when groups pay for the memory they hold, and the bytes a
plan's replicas send over one or two axes (`lit3d.planner.search` ranks by them, `lit3d.planner.report` says why).

Candidates are `lit3d.planner.search.Candidate`s (a layout, its settings and its plan)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lit3d.parallel.layout import Layout
from lit3d.planner.inputs import Plan


def one_group_run(candidate: Any) -> tuple:
    """What names ``candidate``'s run over one group of every replica: its layout without shard groups, its ZeRO stage
    and recompute."""
    run = candidate.parallelism
    return replace(candidate.layout, dp_shard=None), run.zero_stage, run.activation_checkpointing


# HSDP's shard groups hold more than one group of every replica: chosen only when they are this much faster.
GROUPS_PAY = 0.01


def unpaid_groups(candidates: list[Any]) -> dict[int, float]:
    """The layouts with HSDP's shard groups that are not `GROUPS_PAY` faster than the same run over one group (by id),
    with that run's step time."""
    whole = {one_group_run(c): c.plan.step_time_s for c in candidates if c.layout.dp_shard is None}
    unpaid = {}
    for c in candidates:
        base = whole.get(one_group_run(c)) if c.layout.dp_shard is not None else None
        if base is not None and c.plan.step_time_s >= (1 - GROUPS_PAY) * base:
            unpaid[id(c)] = base
    return unpaid


def ranking_times(candidates: list[Any]) -> dict[int, float]:
    """The step time each candidate ranks by (by id): its own, but a layout with shard groups that do not pay ranks as
    the same run over one group (right after it: `unpaid_groups`)."""
    unpaid = unpaid_groups(candidates)
    return {id(c): max(c.plan.step_time_s, unpaid.get(id(c), 0.0)) for c in candidates}


def check_groups_split_gpus(shard: int | None, gpus: int) -> None:
    """HSDP's groups given must split some layout's replicas: they divide the GPUs (dp x tp x pp x cp = an island's)."""
    if shard and gpus % shard:
        raise ValueError(
            f"data_parallel_shard_size={shard} does not divide the {gpus} GPUs: no layout's replicas split into groups "
            "of that many"
        )


def shard_groups(layout: Layout, shard: int | None) -> list[Layout]:
    """``layout`` with the HSDP shard groups the search tries: the size given, else one group of every replica and
    groups of a node's ranks, two nodes', four nodes', ...; none that do not split its replicas."""
    node = layout.devices_per_node // (layout.tp * layout.cp)
    sizes = [shard] if shard else [None, *(node * 2**k for k in range(8) if node * 2**k < layout.dp)]
    return [replace(layout, dp_shard=n) for n in sizes if n is None or (1 < n < layout.dp and layout.dp % n == 0)]


def data_parallel_bytes(plan: Plan) -> float:
    """Bytes a GPU sends per step to keep the replicas in sync: ``dp``, or HSDP's ``dp_shard`` and ``dp_replicate``."""
    return sum(axis["bytes"] for name, axis in plan.communication_per_step.items() if name.startswith("dp"))
