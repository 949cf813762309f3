"""Gradient clipping by the global norm of a model split over TP shards, ZeRO shards and pipeline stages."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def global_grad_norm(
    parameters: Iterable[torch.Tensor], pipeline_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The 2-norm of all gradients of the whole model, the same value on every rank.

    DTensor gradients carry their own layout: a shard's norm is partial and DTensor sums it over the mesh,
    while a replicated copy counts once, so TP and ZeRO shards are neither missed nor double-counted.
    Pipeline stages hold disjoint parameters, so their squared norms are summed over ``pipeline_group``.
    """
    groups = _by_grad_mesh(parameters)
    squared = torch.zeros((), device=next(iter(groups.values()))[0].device if groups else "cpu")
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = squared + norm.float() ** 2
    if pipeline_group is not None and dist.get_world_size(pipeline_group) > 1:
        dist.all_reduce(squared, group=pipeline_group)
    return squared.sqrt()


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, pipeline_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Scale all gradients so their global norm is at most ``max_norm``; returns the norm before clipping."""
    parameters = list(parameters)
    norm = global_grad_norm(parameters, pipeline_group)
    for group in _by_grad_mesh(parameters).values():  # foreach kernels cannot mix DTensors and tensors
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


def _by_grad_mesh(parameters: Iterable[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """Parameters that have a gradient, grouped by the gradient's DTensor mesh (plain tensors under None)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    return groups
