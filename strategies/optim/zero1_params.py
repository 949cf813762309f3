"""What ZeRO-1 knows of one parameter: the plain view its optimizer steps, the slice of it each data-parallel rank
owns, and the gradient set aside for it between backwards (`lit3d.strategies.optim.zero1.LocalShardOptimizer` keeps one
per parameter; `lit3d.strategies.optim.zero1_buckets` moves many in one collective)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor


class SlicedParam:
    """One parameter: the model's parameter, the plain view the optimizer steps, and where that view lies in the
    global tensor (``mesh`` and ``placements``; ``dim``: the dim ZeRO-1 splits over DP)."""

    def __init__(
        self,
        param: torch.Tensor,
        view: torch.Tensor | None,
        mesh: Any = None,
        placements: Any = None,
        dim: int | None = None,
        dp_dim: str = "dp",
    ) -> None:
        self.param, self.view, self.mesh, self.placements, self.dim = param, view, mesh, placements, dim
        self.dp_dim = dp_dim  # the mesh dim ZeRO-1 slices over ("dp_cp" with CP, "edp" for MoE experts)
        self.tp_sharded = False  # split over TP: every TP rank's part counts in the gradient norm
        self.grad_aside: torch.Tensor | None = None  # with master weights: backward's gradients so far

    @torch.no_grad()
    def set_grad_aside(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook (master weights): move the gradient backward left to ``grad_aside``, adding it
        to the earlier backwards' in fp32, as fp32 parameters would (gradient accumulation, pipeline micro-batches);
        a single backward's bf16 gradient stays as it is."""
        grad, param.grad = self.like_param(param.grad), None
        self.grad_aside = grad if self.grad_aside is None else self.grad_aside.float().add_(grad)

    def take_grad(self) -> torch.Tensor | None:
        """The parameter's gradient (what backward set aside and left), laid out as the parameter; taken from it."""
        grad, aside = self.param.grad, self.grad_aside
        self.param.grad = self.grad_aside = None
        grad = None if grad is None else self.like_param(grad)
        return grad if aside is None else aside if grad is None else aside.float().add_(grad)

    def like_param(self, grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) and grad.placements != self.param.placements:
            # e.g. the tied embedding's gradient, still replicated when backward hands it over: take its shard
            grad = grad.redistribute(placements=self.param.placements)
        return grad

    @functools.cached_property
    def dp(self) -> tuple[Any, int, int]:
        """(process group, size, this rank's index) of the DP dim."""
        dp = self.mesh[self.dp_dim]
        return dp.get_group(), dp.size(), dp.get_local_rank()

    @functools.cached_property
    def replicate(self) -> tuple[Any, int] | None:
        """(process group, size) of HSDP's replicas of this rank's shard group, which all-reduce the slices' gradients
        after the group's reduce-scatter; None without shard groups."""
        if self.mesh is None or "dp_replicate" not in (self.mesh.mesh_dim_names or ()):
            return None
        mesh = self.mesh["dp_replicate"]
        return mesh.get_group(), mesh.size()

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``tensor`` (the parameter or its gradient) that the optimizer steps, as a view."""
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if self.dim is None:
            return local
        _, size, rank = self.dp
        return rank_chunk(local, self.dim, size, rank)

    def slices(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every DP rank's slice of ``tensor``'s local part (torch.chunk's split, as DTensor's ``Shard``)."""
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        _, size, _ = self.dp
        return [rank_chunk(local, self.dim, size, r) for r in range(size)]

    @functools.cached_property
    def slice_numel(self) -> int:
        """Elements of the largest DP slice (what each rank contributes to a collective, padded)."""
        return max(s.numel() for s in self.slices(self.param))


def rank_chunk(tensor: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """``torch.chunk``'s split of ``dim`` (the one DTensor's ``Shard`` uses, trailing parts may be empty)."""
    size = tensor.shape[dim]
    step = -(-size // parts)
    start = min(index * step, size)
    return tensor.narrow(dim, start, min(step, size - start))
