"""Muon (Jordan et al. 2024; Moonshot's "Muon is Scalable", 2025) for the hidden matrices, AdamW for the rest, in one
optimizer (`Muon`), as Kimi K2 and Moonlight trained.

A Muon group's parameter steps by its momentum orthogonalised: ``B ← μB + (1 − μ)g``, ``O = NS₅((1 − μ)g + μB)``
(Nesterov), the
weight decayed and ``O`` added times the learning rate, scaled so that the update's RMS matches AdamW's
(``0.2·√max(A, B)``, Moonshot's rule, so AdamW's learning rate and weight decay carry over) or Keller Jordan's
``√max(1, A/B)``. ``NS₅`` is five steps of the quintic Newton–Schulz iteration of ``torch.optim.Muon`` (its
coefficients, its normalisation), in bf16 on a GPU as there, in fp32 on a CPU (``ns_dtype=None``; one dtype
where it says: measured on this project's 2-core CPU, one 768 x 256 matrix took 0.52 s in bf16 and 0.011 s in fp32,
which made a small model's Muon step 17x its AdamW step). A stacked
expert tensor ``[expert, in, out]`` is each expert's own matrix. An AdamW group steps as ``torch.optim.AdamW``.

NOTE: written here rather than used from ``torch.optim.Muon``, which takes 2-D parameters only and orthogonalises the
tensor it holds: under tensor parallelism and ZeRO a rank holds a part of each matrix. The iteration needs the whole
matrix. A matrix that one group of ranks splits (ZeRO-1's slices, ZeRO-2/3's shards or TP's parts) is orthogonalised
on one rank of the group, which sends the others their parts (`lit3d.models.muon_spread`); one split by two groups
(ZeRO x TP) is gathered whole (`whole_matrix`), orthogonalised on every rank that holds a part of it, and cut back to
this rank's part (`local_part`). Both are exact: the same whole matrix, the same iteration. A stack of experts split
along its experts only holds each expert whole (`holds_whole_experts`): orthogonalised where it is, with no gather.
The momentum, the weight decay and AdamW are elementwise and run on the parts. ZeRO-1 steps plain slices of each
matrix and gives the ways to make them whole of its own (`lit3d.strategies.optim.zero1.LocalShardOptimizer`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from lit3d.models.muon_spread import SpreadMatrix, orthogonalise_spread, split_over_one_group
from lit3d.models.optimizer_settings import RMS_RULES

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)


def newton_schulz(update: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The update's nearest semi-orthogonal matrix, approximately (``torch.optim.Muon``'s iteration); a stack
    ``[..., rows, cols]`` is orthogonalised matrix by matrix. Returned in ``dtype``."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.transpose(-2, -1)
    norm = x.norm() if x.ndim == 2 else x.norm(dim=(-2, -1), keepdim=True)  # (a matrix's as torch.optim.Muon takes it)
    x = x / norm.clamp(min=1e-7)
    fused = torch.addmm if x.ndim == 2 else torch.baddbmm  # (torch.optim.Muon's fused products: the same rounding)
    for _ in range(steps):
        gram = x @ x.transpose(-2, -1)
        x = fused(x, fused(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.transpose(-2, -1) if tall else x


def rms_scale(shape: tuple[int, ...], rule: str) -> float:
    """The factor on the learning rate of a matrix ``[out, in]`` (an ``nn.Linear``'s), or of each of a stack of
    experts' ``[expert, in, out]`` (`lit3d.models.moe.Experts`)."""
    rows, cols = (shape[-1], shape[-2]) if len(shape) == 3 else (shape[-2], shape[-1])
    return 0.2 * math.sqrt(max(rows, cols)) if rule == "match_rms_adamw" else math.sqrt(max(1.0, rows / cols))


def whole_matrix(param: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """``update`` whole: a DTensor's shards gathered (every rank of its mesh gets the whole), a tensor as it is.

    NOTE: a matrix split over two mesh dims (ZeRO-3 x TP) is gathered in two all-gathers one after the other, which
    DTensor warns of at every step on every rank: expected here (docs/muon.md says what Muon's gathers cost), so its
    logger is quieted for the gather."""
    if not hasattr(update, "full_tensor"):
        return update
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute.level
    redistribute.setLevel(logging.ERROR)
    try:
        return update.full_tensor()
    finally:
        redistribute.setLevel(level)


def holds_whole_experts(param: torch.Tensor) -> bool:
    """Whether ``param`` is a stack of experts ``[expert, in, out]`` split only along its experts (EP's shards, and
    ZeRO-2/3's over them): each expert's matrix is then whole on the rank that holds it, orthogonalised there with no
    gather."""
    placements = getattr(param, "placements", None)
    return (
        placements is not None
        and param.ndim == 3
        and all(not p.is_shard() or getattr(p, "dim", None) == 0 for p in placements)
    )


def local_part(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole`` as ``param`` is placed (a DTensor's shard, cut with no communication)."""
    if not hasattr(param, "device_mesh"):
        return whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)


class Muon(torch.optim.Optimizer):
    """Muon on the groups with ``muon=True``, AdamW on the others (see the module's docstring).

    Args:
        params: Parameter groups; a group's ``muon`` flag chooses its rule.
        lr, weight_decay: Both rules' (a group may set its own).
        betas, eps: AdamW's.
        momentum, nesterov, ns_steps, ns_dtype, rms_rule: Muon's (``rms_rule``: ``"match_rms_adamw"`` or
            ``"original"``).
        whole: ``whole(param, tensor)``: ``tensor`` (this rank's part of ``param``'s update) made the whole matrix.
        shard: ``shard(param, tensor)``: this rank's part of the whole ``tensor``.
        names: Every parameter's name, group by group in order (what `rescale_after_step` names them by).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: torch.dtype | None = None,
        rms_rule: str = "match_rms_adamw",
        whole: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        shard: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        names: list[str] | None = None,
    ) -> None:
        if rms_rule not in RMS_RULES:
            raise ValueError(f"rms_rule={rms_rule!r} is not one of {', '.join(RMS_RULES)}")
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, ns_dtype=ns_dtype, rms_rule=rms_rule, muon=False)  # fmt: skip
        super().__init__(params, defaults)
        self.whole, self.shard = whole or whole_matrix, shard or local_part
        self.part: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = laid_out_as
        self.placed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] = _dtensor_or_none
        self.names = names or []
        self.rescales: dict[str, torch.Tensor] = {}  # for the next step (`rescale_after_step`)

    def lay_out(
        self,
        whole: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        shard: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        part: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        placed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None],
    ) -> None:
        """``whole`` and ``shard`` (as the constructor takes them) from a strategy that sliced the parameters after the
        module built this optimizer (ZeRO-1: `lit3d.strategies.optim.zero1.LocalShardOptimizer`); ``part(param,
        rows)``: one factor per row of ``param``'s whole tensor, laid out as the part of it ``param`` is
        (`laid_out_as`); ``placed(param, update)``: the update as a DTensor of the whole matrix (None where ``param``
        is not a part of one)."""
        self.whole, self.shard, self.part, self.placed = whole, shard, part, placed

    def rescale_after_step(self, factors: dict[str, torch.Tensor]) -> None:
        """After the next step's updates, multiply each row of each parameter named in ``factors`` by its factor (one
        per row of the whole tensor), on what this optimizer steps (shards, ZeRO-1's slices and master weights):
        QK-clip's (`lit3d.models.qk_clip`)."""
        unknown = set(factors) - set(self.names)
        if unknown:
            raise KeyError(f"rescale_after_step: no parameter of this optimizer is named {sorted(unknown)}")
        self.rescales = factors

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        spread: list[tuple[torch.Tensor, dict, SpreadMatrix]] = []  # matrices orthogonalised on one rank of a group
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if not group["muon"]:
                    self._adamw(param, group)
                    continue
                matrix = self._spread_matrix(param)
                if matrix is None:
                    self._muon(param, group, self._momentum(param, group))
                else:
                    spread.append((param, group, matrix))
        if spread:
            orthogonalise_spread(
                [matrix for _, _, matrix in spread],
                lambda i: self._momentum(spread[i][0], spread[i][1]),
                lambda i, whole: self._orthogonal(whole, spread[i][1]),
                lambda i, part: self._add_orthogonal(spread[i][0], spread[i][1], spread[i][2].shape, part),
            )
        if self.rescales:
            params = (param for group in self.param_groups for param in group["params"])
            for name, param in zip(self.names, params):
                if name in self.rescales:
                    param.mul_(self.part(param, self.rescales[name]).to(param.dtype))
            self.rescales = {}
        return loss

    def _momentum(self, param: torch.Tensor, group: dict) -> torch.Tensor:
        """The momentum moved by the gradient, and the update it makes (Nesterov's where set)."""
        grad, state = param.grad, self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buffer = state["momentum_buffer"]
        buffer.lerp_(grad, 1 - group["momentum"])  # (torch.optim.Muon's average: NS₅ normalises the scale away)
        return grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer

    def _spread_matrix(self, param: torch.Tensor) -> SpreadMatrix | None:
        """``param`` as a matrix whose parts one group of ranks holds (`lit3d.models.muon_spread`), else None."""
        if holds_whole_experts(param):
            return None
        placed = self.placed(param, param.grad)  # (laid out as its update will be)
        split = split_over_one_group(placed)
        if split is None:
            return None
        return SpreadMatrix(tuple(placed.shape), split[1], split[0], placed.to_local())

    def _orthogonal(self, whole: torch.Tensor, group: dict) -> torch.Tensor:
        dtype = group["ns_dtype"] or (torch.bfloat16 if whole.device.type == "cuda" else torch.float32)
        return newton_schulz(whole, group["ns_steps"], dtype)

    def _muon(self, param: torch.Tensor, group: dict, update: torch.Tensor) -> None:
        """The matrix orthogonalised on this rank: gathered whole where it is split (over two groups), as it is where
        this rank holds it whole (a stack of experts: each of this rank's)."""
        own = holds_whole_experts(param)  # (each expert its own matrix: this rank's are whole already)
        whole = update.to_local() if own else self.whole(param, update)
        orthogonal = self._orthogonal(whole, group)
        part = orthogonal if own else self.shard(param, orthogonal)
        self._add_orthogonal(param, group, tuple(whole.shape), part)

    def _add_orthogonal(self, param: torch.Tensor, group: dict, shape: tuple[int, ...], part: torch.Tensor) -> None:
        """Weight decay, then this rank's ``part`` of the orthogonalised update of a matrix of ``shape``."""
        lr = group["lr"] * rms_scale(shape, group["rms_rule"])
        param.mul_(1 - group["lr"] * group["weight_decay"])
        local = param.to_local() if hasattr(param, "to_local") and not hasattr(part, "to_local") else param
        local.add_(part.to(param.dtype), alpha=-lr)

    def _adamw(self, param: torch.Tensor, group: dict) -> None:
        grad, state = param.grad, self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        (beta1, beta2), lr = group["betas"], group["lr"]
        state["step"] += 1
        step = float(state["step"])
        param.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        param.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))


def laid_out_as(param: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (one factor per row of ``param``'s whole tensor) expanded to its whole shape and cut as ``param`` is (a
    DTensor's shard; a plain tensor is whole)."""
    whole = rows.to(param.device, torch.float32).view(-1, *([1] * (param.ndim - 1))).expand(param.shape)
    return local_part(param, whole.contiguous() if hasattr(param, "device_mesh") else whole)


def _dtensor_or_none(param: torch.Tensor, update: torch.Tensor) -> torch.Tensor | None:
    return update if hasattr(update, "placements") else None
