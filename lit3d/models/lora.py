"""LoRA: low-rank adapters on a block's linears, trained while every other weight stays frozen (Hu et al. 2021).

A targeted linear computes ``x Wᵀ + (alpha / rank) · dropout(x) Aᵀ Bᵀ``, with PEFT's shapes and its start: ``A``
``(rank, in)`` drawn as PEFT draws it (uniform in ±1/√in, seeded by the parameter's name like every lit3d weight,
so any layout starts the same), ``B`` ``(out, rank)`` zero, so training starts from the base model exactly. The
adapters follow their linear's tensor-parallel split (`strategies.tensor_parallel`): a column-parallel linear splits
``B`` along its output and keeps ``A`` whole, a row-parallel one splits ``A`` along its input and keeps ``B`` whole,
so the base layer's own collective carries the adapter's share too and no other runs. An MoE layer's experts take
``gate``, ``up`` and ``down`` adapters per expert, stacked as their weights are (`lit3d.models.moe.Experts`). Dropout's
masks are drawn from each element's place in the run, so every layout drops what one process drops
(`lit3d.models.lora_dropout`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lit3d.models.batch_context import NO_CONTEXT, BatchContext
from lit3d.models.lora_dropout import LayoutFreeDropout
from lit3d.models.lora_settings import ADAPTERS, ROLES, LoRA  # noqa: F401 (read from here too)


class LoRALinear(nn.Linear):
    """A linear with a low-rank adapter beside its weight (see the module's docstring)."""

    def __init__(self, in_features: int, out_features: int, lora: LoRA, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.lora_a = nn.Parameter(torch.empty(lora.rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(out_features, lora.rank))
        self.scaling = lora.scaling
        self.dropout = LayoutFreeDropout(lora.dropout)

    def forward(self, x: torch.Tensor, context: BatchContext = NO_CONTEXT) -> torch.Tensor:
        dropped = self.dropout(x, context.samples) if self.dropout.p > 0 else x
        adapted = F.linear(F.linear(dropped, self.lora_a), self.lora_b)
        return F.linear(x, self.weight, self.bias) + self.scaling * adapted


def project(layer: nn.Module, x: torch.Tensor, context: BatchContext) -> torch.Tensor:
    """``layer(x)`` for a linear that `linear` built; a LoRA linear is also handed the batch's ``context`` (its
    dropout's rows).

    NOTE: by keyword, which tensor parallelism's input hook on a linear passes on (it keeps one positional argument);
    and to LoRA linears only: a plain one may be torchao's FP8 linear, which takes its input alone."""
    return layer(x, context=context) if isinstance(layer, LoRALinear) else layer(x)


def linear(in_features: int, out_features: int, lora: LoRA | None, name: str, bias: bool = False) -> nn.Linear:
    """The linear a block builds as ``name`` (``attn.q_proj``): with an adapter where ``lora`` targets it."""
    if lora is not None and name in lora.module_names():
        return LoRALinear(in_features, out_features, lora, bias)
    return nn.Linear(in_features, out_features, bias=bias)


def init_adapter(name: str, tensor: torch.Tensor, generator: torch.Generator) -> bool:
    """Draw an adapter's start into ``tensor`` (whole) if ``name`` is one; False otherwise. ``A`` as PEFT draws it
    (Kaiming-uniform with a = √5: uniform in ±1/√in), ``B`` zero."""
    if name.endswith(ADAPTERS[0]):  # (rank, in), or an MoE layer's (expert, in, rank)
        bound = 1 / math.sqrt(tensor.shape[1])
        tensor.uniform_(-bound, bound, generator=generator)
        return True
    if name.endswith(ADAPTERS[1]):
        tensor.zero_()
        return True
    return False


def freeze_all_but_adapters(network: nn.Module) -> None:
    """Only the adapters train: every other parameter gets no gradient and no optimizer state."""
    for name, param in network.named_parameters():
        param.requires_grad_(name.endswith(ADAPTERS))
