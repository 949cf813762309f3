"""Plain tensors for a checkpoint: a tensor subclass that wraps another (torchao's FP8 all-gather weights, and the
optimizer states made like them) is saved as the tensor it wraps, so that reading a checkpoint needs no torchao."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def plain_tensors(tree: Any) -> Any:
    """``tree`` (dicts and lists of a checkpoint), in place, with every tensor that wraps another (FP8 all-gather's
    weights, and the optimizer states made like them) replaced by the tensor it wraps, sharing its storage: what a
    checkpoint saves, so that reading one needs no torchao, and what a load fills, in place.

    NOTE: torchao's wrapper would otherwise be pickled into the checkpoint by its class name."""
    from torch.distributed.tensor import DTensor

    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in list(items):
        if isinstance(value, (dict, list)):
            plain_tensors(value)
        elif isinstance(value, DTensor) and _wraps(value._local_tensor):
            tree[key] = DTensor.from_local(
                unwrapped(value._local_tensor),
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        elif isinstance(value, torch.Tensor) and _wraps(value):
            tree[key] = unwrapped(value)
    return tree


def _wraps(tensor: torch.Tensor) -> bool:
    """A tensor subclass that wraps another (torchao's), not a DTensor (whose shards are placed, not wrapped)."""
    from torch.distributed.tensor import DTensor

    wrapper = type(tensor) not in (torch.Tensor, nn.Parameter) and hasattr(tensor, "__tensor_flatten__")
    return wrapper and not isinstance(tensor, DTensor)


def unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a wrapper subclass (torchao's FP8 all-gather weights); any other tensor as it is."""
    while _wraps(tensor):
        tensor = getattr(tensor, tensor.__tensor_flatten__()[0][0])
    return tensor
