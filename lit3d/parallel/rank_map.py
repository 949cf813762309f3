"""What rank 0 logs of a run's layout at the start: the rank map (node, rank and coordinates, with the groups), and
the lines that say what ``"auto"`` became and which pipeline schedule runs."""

from __future__ import annotations

from typing import Any

from lit3d.parallel.layout import Layout
from lit3d.parallel.schedules import describe_schedule


def rank_map(layout: Layout, max_rows: int = 64) -> str:
    """A table of node, rank and (p, d, t) per rank (with c: context parallelism), with the group sizes; rank 0
    prints it at start."""
    lines = [
        f"lit3d layout: {layout.world_size} ranks = {layout.grid}, "
        f"{layout.num_nodes} node(s) x {layout.devices_per_node} device(s)",
        f"groups: tensor-parallel of {layout.tp} (consecutive ranks), "
        + (f"context-parallel ring of {layout.cp} (stride {layout.tp}), " if layout.cp > 1 else "")
        + f"data-parallel of {layout.dp} (stride {layout.tp * layout.cp}), pipeline of {layout.pp} "
        f"(stride {layout.tp * layout.cp * layout.dp})",
    ]
    if layout.cp > 1:
        lines.append(
            f"each context-parallel rank c holds sequence chunks c and {2 * layout.cp - 1}-c of {2 * layout.cp}; "
            f"weights are synced over the {layout.replicas} dp x cp replicas"
        )
    if layout.dp_replicate > 1:
        lines.append(
            f"HSDP: ZeRO shards over groups of {layout.shard_size} consecutive data-parallel ranks (stride "
            f"{layout.tp * layout.cp}); the {layout.dp_replicate} groups replicate one another and all-reduce the "
            "shards' gradients once per step"
        )
    if layout.ep > 1:
        lines.append(
            f"expert-parallel of {layout.ep} (consecutive data-parallel ranks, stride {layout.tp * layout.cp}) split "
            f"each MoE layer's experts; {layout.dp // layout.ep} such group(s) hold the same experts"
        )
    if layout.islands > 1:
        lines.append(
            f"islands: {layout.islands} of {layout.island_size} consecutive ranks each, synced only at DiLoCo's outer "
            f"step (ranks {layout.island_size} apart: same p, d, t); the global batch is split over all "
            f"{layout.data_replicas} replicas"
        )
    crossing = layout.tp_groups_across_nodes()
    if crossing:
        lines.append(f"WARNING: {len(crossing)} tensor-parallel group(s) span nodes, e.g. ranks {crossing[0]}")
    lines.append(
        "node  rank  "
        + ("island  " if layout.islands > 1 else "")
        + ("(p, d, c, t)" if layout.cp > 1 else "(p, d, t)")
        + ("  ep group, experts" if layout.ep > 1 else "")
        + ("  shard group, shard" if layout.dp_replicate > 1 else "")
    )
    for rank in range(min(layout.world_size, max_rows)):
        p, d, c, t = layout.coordinate(rank)
        flag = "  <- TP group spans nodes" if any(rank in g for g in crossing) else ""
        experts = f"  {d // layout.ep}, part {d % layout.ep + 1}/{layout.ep}" if layout.ep > 1 else ""
        where = f"({p}, {d}, {c}, {t})" if layout.cp > 1 else f"({p}, {d}, {t})"
        island = f"{layout.island(rank):>6}  " if layout.islands > 1 else ""
        n = layout.shard_size
        groups = f"  {d // n}, shard {d % n + 1}/{n}" if layout.dp_replicate > 1 else ""
        lines.append(f"{layout.node(rank):>4}  {rank:>4}  {island}{where}{experts}{groups}{flag}")
    if layout.world_size > max_rows:
        lines.append(f"... {layout.world_size - max_rows} more ranks, same pattern")
    return "\n".join(lines)


def layout_lines(layout: Layout, parallelism: Any, microbatches: int, lit3d_splits: bool) -> list[str]:
    """What rank 0 logs at the start: the rank map, what ``tensor_parallel_size="auto"`` became and by which
    convention (``lit3d_splits``: whether lit3d splits the module, or the module parallelises itself), and with a
    pipeline the schedule (``parallelism``: the run's `lit3d.parallel.Parallelism`)."""
    lines = [rank_map(layout)]
    if parallelism.tensor_parallel_size == "auto":
        # NOTE: for a module lit3d splits, 'auto' is 1 unless asked: a line saying so on every data-parallel run
        # tells nothing; a module that parallelises itself gets Lightning's convention, which is worth naming.
        if not lit3d_splits:
            lines.append(
                f"tensor_parallel_size='auto' is {layout.tp}: the devices of a node, as Lightning's "
                "ModelParallelStrategy, for a module that parallelises itself"
            )
        if parallelism.sequence_parallel and layout.tp == 1:
            lines.append("sequence_parallel=True does nothing here: tensor_parallel_size is 1")
    if layout.pp > 1:
        p = parallelism
        lines.append(describe_schedule(p.pipeline_schedule, layout.pp, microbatches, p.chunks_per_rank))
    return lines
