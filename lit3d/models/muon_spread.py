"""Muon's iteration spread over the ranks that split a matrix (`lit3d.models.muon`): instead of every rank gathering
every matrix whole and orthogonalising it, each matrix is orthogonalised on one rank of the group, which sends each
rank back its part.

The matrices of a group (the ranks that each hold a part of them along one dim: ZeRO-1's slices, ZeRO-2/3's shards,
or tensor parallelism's parts) go in rounds of as many matrices as the group has ranks, in the optimizer's order; in
a round, the group's ``k``-th rank orthogonalises the round's ``k``-th matrix. One all-to-all sends each rank's parts
to their matrices' ranks, and a second sends the orthogonalised parts back, so each rank holds at most one whole
matrix (and its iteration's temporaries) at a time and runs the iteration on 1/n of the matrices.

NOTE: written here, not taken from a library: torch.optim.Muon is single-device, and the distributed Muons of
Megatron-Core, torchtitan and Moonshot each fit their own parameter containers. The result is bitwise the gather-all
path's (the same whole matrix, the same iteration on it), so every layout keeps the single process's update; the
bytes are the planner's (`lit3d.planner.muon.spread_elements`), about those of the all-gather it replaces for two
ranks, 2/n of them for n.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lit3d.parallel.sharding import part_sizes


@dataclass
class SpreadMatrix:
    """A matrix whose parts a group of ranks holds, one part each along ``dim``."""

    shape: tuple[int, ...]  # the whole matrix's
    dim: int
    group: Any  # the process group that splits it
    part: torch.Tensor  # this rank's part of the matrix (its gradient, say: the update's shape, dtype and device)


def split_over_one_group(placed: Any) -> tuple[Any, int] | None:
    """(process group, dim) where ``placed`` (a DTensor of a matrix) is split along one dim over one of its mesh's dims
    and replicated over the others (HSDP's replicas each hold the same parts); None otherwise (a matrix split over
    two groups, ZeRO-3 x TP say, is gathered whole instead)."""
    from torch.distributed.tensor import Shard

    if placed is None or not hasattr(placed, "placements") or placed.ndim != 2:
        return None
    mesh = placed.device_mesh  # (a split over one rank is none: the planner's count agrees)
    shards = [(i, p) for i, p in enumerate(placed.placements) if not p.is_replicate() and mesh.size(i) > 1]
    if len(shards) != 1 or type(shards[0][1]) is not Shard:
        return None
    mesh_dim, placement = shards[0]
    return mesh.get_group(mesh_dim), placement.dim


def part_shape(shape: tuple[int, ...], dim: int, parts: int, index: int) -> tuple[int, ...]:
    return tuple(part_sizes(shape[dim], parts)[index] if d == dim else s for d, s in enumerate(shape))


def orthogonalise_spread(
    matrices: list[SpreadMatrix],
    update: Callable[[int], torch.Tensor],
    orthogonalise: Callable[[int, torch.Tensor], torch.Tensor],
    apply: Callable[[int, torch.Tensor], None],
) -> None:
    """Orthogonalise each matrix's update whole (``orthogonalise(index, whole)``) on one rank of its group (see the
    module's docstring) and hand this rank's part of the result, in the update's dtype, to ``apply(index, part)``. A
    round asks ``update(index)`` for this rank's part of its matrices' updates when it starts and applies their results
    when it ends, so a rank holds a round's updates at a time, not every matrix's. Every rank of a group passes the
    group's matrices in the same order."""
    by_group: dict[tuple, list[int]] = {}
    for index, matrix in enumerate(matrices):  # (one dtype per all-to-all)
        by_group.setdefault((matrix.group.group_name, matrix.part.dtype), []).append(index)
    for indices in by_group.values():
        group = matrices[indices[0]].group
        ranks = dist.get_world_size(group)
        for start in range(0, len(indices), ranks):
            _round(matrices, indices[start : start + ranks], group, (update, orthogonalise, apply))


def _round(matrices: list[SpreadMatrix], indices: list[int], group: Any, steps: tuple[Callable, ...]) -> None:
    """One round: the ``k``-th of ``indices`` orthogonalised on the group's ``k``-th rank (``steps``: the update, the
    iteration and the apply of `orthogonalise_spread`). NOTE: each buffer is let go as soon as the next is made, so a
    rank holds about two matrices' worth at a time besides the iteration's."""
    update, orthogonalise, apply = steps
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    splits = [(matrices[i].shape, matrices[i].dim) for i in indices]
    sizes = [[math.prod(part_shape(shape, dim, ranks, r)) for r in range(ranks)] for shape, dim in splits]
    mine = [row[me] for row in sizes] + [0] * (ranks - len(indices))  # my part of each matrix, to its rank
    owned = indices[me] if me < len(indices) else None
    theirs = sizes[me] if owned is not None else [0] * ranks  # every rank's part of the one I orthogonalise
    like = matrices[indices[0]].part
    sent = torch.cat([_local(update(i)).reshape(-1) for i in indices])
    received = like.new_empty(sum(theirs))
    dist.all_to_all_single(received, sent, theirs, mine, group=group)
    del sent
    back = like.new_empty(0)
    if owned is not None:
        shape, dim = matrices[owned].shape, matrices[owned].dim
        whole = torch.cat([p.view(part_shape(shape, dim, ranks, r)) for r, p in enumerate(received.split(theirs))], dim)
        del received
        orthogonal = orthogonalise(owned, whole).to(like.dtype)
        del whole
        back = torch.cat([part.reshape(-1) for part in orthogonal.split(part_sizes(shape[dim], ranks), dim)])
        del orthogonal
    parts = like.new_empty(sum(mine))
    dist.all_to_all_single(parts, back, mine, theirs, group=group)
    del back
    for index, piece in zip(indices, parts.split(mine)):
        apply(index, piece.view(matrices[index].part.shape))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
