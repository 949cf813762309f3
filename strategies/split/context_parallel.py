"""Context parallelism in the strategy: the checks, the ring on each attention layer, each rank's share of a batch.

The algorithm (load-balanced chunks, ring attention) is `lit3d.models.ring_attention`. Here: a CP rank's module still
receives whole sequences from the data (CP ranks of a replica are dealt the same batch), and its runner
(`lit3d.models.runner.ContextShare`) keeps this rank's two chunks of inputs and targets; every attention layer gets the
CP ring (`apply_context_parallel`). Everything else is per token, and the weights are synced over the ``dp × cp``
replicas. Each CP rank's loss is the mean over its tokens; every rank holds as many, so the mean of the ranks'
losses (and of their gradients) is the mean over all tokens of the global batch.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from lit3d.models.ring_attention import ContextParallel


def check_module_for_context_parallel(module: Any, cp: int, predicting: bool = False) -> None:
    """Refuse a module context parallelism cannot split: it needs lit3d's protocol (a ``tensor_parallel_plan``, and
    ``inputs_and_targets`` to cut each rank's tokens from), and whole sequences on every rank to predict."""
    if cp == 1:
        return
    if not (hasattr(module, "tensor_parallel_plan") and hasattr(module, "inputs_and_targets")):
        raise TypeError(
            f"context_parallel_size={cp} needs a module the strategy splits, with `inputs_and_targets(batch)` "
            f"(like lit3d.GPT); {type(module).__name__} parallelises itself: use context_parallel_size=1"
        )
    if predicting:
        raise ValueError(
            f"context_parallel_size={cp} splits every sequence over ranks, but prediction samples from whole "
            "sequences: predict with context_parallel_size=1 (a checkpoint loads in any layout)"
        )


def apply_context_parallel(network: nn.Module, group: Any, size: int, rank: int) -> None:
    """Give every layer of ``network`` that has a ``context_parallel`` attribute the CP ring: attention, and MoE
    layers (their balance loss is per whole sequence)."""
    cp = ContextParallel(group, size, rank)
    for module in network.modules():
        if hasattr(module, "context_parallel"):
            module.context_parallel = cp
