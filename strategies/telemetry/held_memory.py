"""Per-rank memory accounting: bytes this rank holds in parameters, gradients and optimizer states (master weights
included)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from lit3d.checkpoint.plain import unwrapped


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's plain tensor: a DTensor's shard, and inside a wrapper subclass (FP8 all-gather's weights,
    `lit3d.strategies.split.float8`) the tensor it wraps."""
    return unwrapped(tensor.to_local() if isinstance(tensor, DTensor) else tensor)


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of this rank's part of each tensor (a DTensor's shard), each storage counted once."""
    seen, total = set(), 0
    for tensor in tensors:
        local = _local(tensor)
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), local.numel())
        if local.numel() and key not in seen:
            seen.add(key)
            total += local.numel() * local.element_size()
    return total


def memory_by_component(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, int]:
    """``params``, ``grads``, ``optimizer`` and ``total`` bytes held by this rank right now.

    Measure after backward and before ``zero_grad`` (e.g. in ``on_before_optimizer_step``) to see gradients;
    optimizer states exist from the first step on.
    """
    params = list(module.parameters())
    states = [
        value
        for optimizer in optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    stepped = [p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]]
    held = {_local(p).untyped_storage().data_ptr() for p in params}
    masters = [p for p in stepped if _local(p).untyped_storage().data_ptr() not in held]
    report = {
        "params": local_bytes(params),
        # The optimizer's own parameters may be slices with gradients of their own (ZeRO-1's DP averages).
        "grads": local_bytes(p.grad for p in [*params, *stepped] if p.grad is not None),
        # Parameters of its own (ZeRO-1's fp32 master weights of bf16 parameters) are optimizer state too.
        "optimizer": local_bytes([*states, *masters]),
    }
    report["total"] = sum(report.values())
    return report


def memory_line(memory: dict[str, int]) -> str:
    """The rank-0 log line of the planner's bytes for rank 0's stage (``memory_by_stage``)."""
    sizes = ", ".join(f"{key} {value / 2**20:.1f} MiB" for key, value in memory.items())
    return f"lit3d plan estimate for rank 0: {sizes}"
