"""Tensor parallelism: a model's plan (module name → role) turned into DTensor parallel styles.

Megatron's pattern: a column-parallel linear splits its output features, the row-parallel linear after it
splits its input features and sums the partial results, so each attention or MLP region costs one all-reduce
forward and one backward. With sequence parallelism the activations between regions stay split along the
sequence, and that all-reduce becomes an all-gather before the region and a reduce-scatter after it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

ROLES = ("colwise", "rowwise", "tp_region", "norm", "vocab_embedding", "vocab_head")
# The dim of its weight each role splits over the TP ranks (an ``nn.Linear`` weight is [out, in], an embedding's
# [vocab, d]); the roles not named here leave their weights whole. The planner counts shards with this.
SHARDED_DIM = {"colwise": 0, "rowwise": 1, "vocab_embedding": 0, "vocab_head": 0}


def parallel_styles(sequence_parallel: bool) -> dict[str, ParallelStyle | None]:
    """The DTensor style for each role; None means the module stays as it is (replicated)."""
    # Between TP regions the residual stream is either replicated or split along the sequence (dim 1).
    between = Shard(1) if sequence_parallel else Replicate()
    return {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(output_layouts=between),
        # NOTE: the region's input becomes one replicated DTensor shared by its column-parallel linears (q, k, v
        # or gate, up), so backward sums their partial input gradients and reduces them once per region.
        "tp_region": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "norm": SequenceParallel() if sequence_parallel else None,
        "vocab_embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        # NOTE: logits stay a vocabulary-sharded DTensor so the loss never gathers them (loss_parallel).
        "vocab_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    }


def apply_tensor_parallel(
    network: nn.Module, plan: dict[str, str], tp_mesh: DeviceMesh, sequence_parallel: bool
) -> None:
    """Parallelise ``network`` in place over ``tp_mesh`` following ``plan`` (name pattern → role)."""
    unknown = sorted(set(plan.values()) - set(ROLES))
    if unknown:
        raise ValueError(f"unknown tensor-parallel roles {unknown}; known roles: {ROLES}")
    styles = parallel_styles(sequence_parallel)
    present = {name for name, _ in network.named_modules()}
    module_plan = {
        pattern: styles[role]
        for pattern, role in plan.items()
        if styles[role] is not None and _matches_any(pattern, present)  # a pipeline stage lacks some modules
    }
    parallelize_module(network, tp_mesh, module_plan)


def lay_out_grads_like_params(parameters: Iterable[torch.Tensor]) -> None:
    """Give each DTensor gradient its parameter's layout (a local slice: no communication).

    NOTE: DTensor's embedding backward returns the vocabulary-parallel embedding's gradient replicated, the
    whole table on every TP rank, where the optimizer needs only this rank's rows. (FSDP2 does the same for
    the parameters it manages, so this matters when there is no data-parallel wrapper.)
    """
    for param in parameters:
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(placements=param.placements)


def check_plan(network: nn.Module, plan: dict[str, str]) -> None:
    """Every pattern of the plan must name modules of the (whole, unsplit) network: a typo would silently
    leave layers unsplit."""
    present = {name for name, _ in network.named_modules()}
    unmatched = [pattern for pattern in plan if not _matches_any(pattern, present)]
    if unmatched:
        raise ValueError(f"tensor_parallel_plan names modules the network does not have: {unmatched}")


def _matches_any(pattern: str, names: set[str]) -> bool:
    from fnmatch import fnmatchcase

    return any(fnmatchcase(name, pattern) for name in names)
