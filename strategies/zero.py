"""Data parallelism with ZeRO sharding over the DP mesh dimension, from PyTorch's FSDP2 building blocks.

==========  ==================  ==================  ===========================  =====================
zero_stage  parameters          gradients           optimizer states             built from
==========  ==================  ==================  ===========================  =====================
0           replicated          all-reduced         replicated                   ``replicate``
1           replicated          all-reduced         sharded (1/D)                ``replicate`` + `ShardedOptimizerStates`
2           gathered once/step  reduce-scattered    sharded                      ``fully_shard(reshard_after_forward=False)``
3           gathered per block  reduce-scattered    sharded                      ``fully_shard``
==========  ==================  ==================  ===========================  =====================

Stage 2 gathers each block's parameters in forward and keeps them until its backward is done (no second
gather), then frees them: between steps a rank holds only its shard, as in stage 3.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard


def apply_data_parallel(network: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh, zero_stage: int,
                        mp_policy: Any = None) -> None:
    """Make ``network`` data parallel over ``dp_mesh`` in place; each of ``blocks`` is one communication unit."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    if zero_stage <= 1:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(network, mesh=dp_mesh, mp_policy=mp_policy)
        return
    reshard = zero_stage == 3
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    # The root holds what is left (embedding, final norm, head); NOTE: not resharded after forward because
    # backward starts with it.
    fully_shard(network, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy)


class ShardedOptimizerStates:
    """ZeRO-1 for one optimizer: each DP rank keeps the optimizer states of 1/D of every parameter.

    The optimizer's parameters are swapped for DTensor views of this rank's slice of each (replicated)
    parameter, split along a tensor dim that tensor parallelism leaves whole; its states are therefore 1/D
    the size, and keyed by tensors whose global shapes equal the parameters' (checkpoints stay layout-free).
    Around each step, `scatter_grads` hands the optimizer its slice of the all-reduced gradient (a view, no
    copy), the step updates the slices in place, and `gather_params` replicates them over DP again (a DTensor
    redistribute: an all-gather per parameter). Create it before the optimizer's first step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, dp_dim: str = "dp") -> None:
        if optimizer.state:
            raise RuntimeError("ZeRO-1 sharding must be set up before the optimizer's first step")
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (model parameter, the optimizer's slice)
        for group in optimizer.param_groups:
            slices = [_dp_slice(param, dp_dim) for param in group["params"]]
            self.pairs += zip(group["params"], slices)
            group["params"] = slices

    def scatter_grads(self) -> None:
        for param, piece in self.pairs:
            piece.grad = None if param.grad is None else _slice_like(param.grad, piece)

    @torch.no_grad()
    def gather_params(self) -> None:
        for param, piece in self.pairs:
            param.to_local().copy_(piece.redistribute(placements=param.placements).to_local())
            # The model's gradients are the ones backward accumulates into: the step has consumed them.
            param.grad = piece.grad = None


def _dp_slice(param: torch.Tensor, dp_dim: str) -> torch.Tensor:
    """A DTensor viewing this DP rank's slice of a parameter replicated over ``dp_dim``."""
    if not isinstance(param, DTensor) or dp_dim not in (param.device_mesh.mesh_dim_names or ()):
        raise TypeError("ZeRO-1 expects parameters made data parallel (DTensors replicated over the DP mesh dim)")
    mesh, placements = param.device_mesh, list(param.placements)
    mesh_dim = mesh.mesh_dim_names.index(dp_dim)
    if not isinstance(placements[mesh_dim], Replicate):
        raise TypeError(f"ZeRO-1 expects parameters replicated over {dp_dim!r}, got {param.placements}")
    taken = {p.dim for p in placements if isinstance(p, Shard)}
    split_dim = next((d for d in range(param.ndim) if d not in taken), None)
    if split_dim is None:
        raise ValueError(f"no tensor dim of a {tuple(param.shape)} parameter is free for ZeRO-1 sharding")
    placements[mesh_dim] = Shard(split_dim)
    with torch.no_grad():
        view = _rank_chunk(param.to_local(), split_dim, mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))
        shard = DTensor.from_local(view, mesh, placements, run_check=False, shape=param.shape, stride=param.stride())
    return nn.Parameter(shard, requires_grad=param.requires_grad)


def _slice_like(grad: DTensor, piece: DTensor) -> DTensor:
    """The gradient's slice matching ``piece`` (a view, no copy)."""
    mesh_dim = next(i for i, (g, p) in enumerate(zip(grad.placements, piece.placements)) if g != p)
    mesh, split_dim = piece.device_mesh, piece.placements[mesh_dim].dim
    view = _rank_chunk(grad.to_local(), split_dim, mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))
    return DTensor.from_local(view, mesh, piece.placements, run_check=False, shape=piece.shape, stride=piece.stride())


def _rank_chunk(tensor: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """``torch.chunk``'s split of ``dim`` (the one DTensor's ``Shard`` uses, trailing parts may be empty)."""
    size = tensor.shape[dim]
    step = -(-size // parts)
    start = min(index * step, size)
    return tensor.narrow(dim, start, min(step, size - start))
