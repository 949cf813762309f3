"""Muon's step as the planner counts it (`lit3d.models.muon`): the bytes its matrices move to be orthogonalised whole
and the Newton-Schulz FLOPs of the busiest rank, per pipeline rank's `StageSums`.

A matrix that one group of ranks splits (ZeRO-1's slices or ZeRO-2/3's shards over the replicas, or TP's parts) is
orthogonalised on one rank of the group, in rounds (`lit3d.models.muon_spread`): each rank sends its parts of the
round's other matrices to their ranks and the orthogonalised parts of its own back. A matrix split by both (ZeRO
and TP) is gathered whole on every rank, over the replicas first (each rank's TP part), then over TP. An expert is
orthogonalised where it is (under ZeRO-1, gathered from its slices over the ranks holding the same experts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lit3d.parallel.sharding import part_sizes
from lit3d.planner.sums import StageSums, newton_schulz_flops
from lit3d.planner.tensors import Tensor

if TYPE_CHECKING:
    from lit3d.planner.inputs import Case


def orthogonal_traffic(case: Case, sums: Sequence[StageSums]) -> dict[str, float]:
    """Bytes the busiest rank sends per step for Muon's matrices (see the module's docstring), in the gradients' dtype
    (ZeRO-1: the optimizer's, fp32 master weights under bf16-mixed): ``dp`` (HSDP's ``dp_shard``) and ``tp``; nothing
    for AdamW. Part of `communication_bytes`; the clock prices it apart, in the optimizer's step (nothing overlaps
    it)."""
    layout, zero = case.layout, case.zero
    if case.training.optimizer != "muon":
        return {}
    element = case.precision.stepped_bytes if zero.slices_optimizer else case.precision.grads
    replicas, tp, traffic = layout.shard_ranks, layout.tp, {}
    # ZeRO-1 slices each expert over the ranks holding the same experts (``edp``); ZeRO-2/3 shard whole experts
    holders = layout.replicas // layout.ep if zero.slices_optimizer else 1
    sharded = (zero.sharded_over_replicas or zero.slices_optimizer) and replicas > 1
    for stage in sums:
        spread, gathered = _split_by(stage.orthogonal, sharded, tp)
        dp = spread_elements(spread["dp"], replicas) + (replicas - 1) / replicas * sum(m // tp for m in gathered)
        if sharded and stage.orthogonal_experts:
            dp += (holders - 1) / holders * stage.orthogonal_experts
        tp_sent = spread_elements(spread["tp"], tp) + (tp - 1) / tp * sum(gathered)
        for axis, sent in (("dp", dp), ("tp", tp_sent)):
            if sent:
                traffic[axis] = max(traffic.get(axis, 0.0), sent * element)
    if zero.hybrid and "dp" in traffic:
        traffic["dp_shard"] = traffic.pop("dp")
    return traffic


def newton_schulz_work(case: Case, stage: StageSums) -> float:
    """The Newton-Schulz FLOPs of the busiest rank of ``stage``'s groups per step: every matrix it orthogonalises whole
    itself, and of those its groups spread, the rounds' share of the rank with the most."""
    if case.training.optimizer != "muon":
        return stage.newton_schulz_flops
    sharded = (case.zero.sharded_over_replicas or case.zero.slices_optimizer) and case.layout.shard_ranks > 1
    spread, _ = _split_by(stage.orthogonal, sharded, case.layout.tp)
    flops = stage.newton_schulz_flops
    for axis, ranks in (("dp", case.layout.shard_ranks), ("tp", case.layout.tp)):
        matrices = spread[axis]
        whole = [newton_schulz_flops(Tensor("", shape, None, None)) for shape, _ in matrices]
        flops += max((sum(whole[r::ranks]) for r in range(ranks)), default=0.0) - sum(whole)
    return flops


def _split_by(
    matrices: tuple[Tensor, ...], sharded: bool, tp: int
) -> tuple[dict[str, list[tuple[tuple[int, ...], int]]], list[int]]:
    """The matrices each group spreads (``dp``, ``tp``: whole shape, the dim it splits), in order, and the elements
    of those two groups split (gathered whole)."""
    spread: dict[str, list[tuple[tuple[int, ...], int]]] = {"dp": [], "tp": []}
    gathered = []
    for t in matrices:
        split_by_tp = tp > 1 and t.tp_dim is not None
        if sharded and split_by_tp:
            gathered.append(math.prod(t.shape))
        elif sharded:  # ZeRO-1 slices the first dim TP leaves whole, FSDP2 shards dim 0: both dim 0 here
            spread["dp"].append((t.shape, 0))
        elif split_by_tp:
            spread["tp"].append((t.shape, t.tp_dim))
    return spread, gathered


def spread_elements(matrices: list[tuple[tuple[int, ...], int]], ranks: int) -> float:
    """Elements the busiest of ``ranks`` sends spreading ``matrices`` (whole shape, the dim split), the ``i``-th
    orthogonalised on rank ``i mod ranks``: its parts of the others' matrices, and the others' parts of its own."""
    if ranks < 2 or not matrices:
        return 0.0
    sent = [0] * ranks
    for index, (shape, dim) in enumerate(matrices):
        row = math.prod(shape) // shape[dim]
        parts = [size * row for size in part_sizes(shape[dim], ranks)]
        owner = index % ranks
        for rank in range(ranks):
            sent[rank] += sum(parts) - parts[rank] if rank == owner else parts[rank]
    return float(max(sent))
