"""LoRA: low-rank adapters on a block's linears, trained while every other weight stays frozen (Hu et al. 2021).

A targeted linear computes ``x Wᵀ + (alpha / rank) · dropout(x) Aᵀ Bᵀ``, with PEFT's shapes and its start: ``A``
``(rank, in)`` drawn as PEFT draws it (uniform in ±1/√in, seeded by the parameter's name like every lit3d weight,
so any layout starts the same), ``B`` ``(out, rank)`` zero, so training starts from the base model exactly. The
adapters follow their linear's tensor-parallel split (`strategies.tensor_parallel`): a column-parallel linear splits
``B`` along its output and keeps ``A`` whole, a row-parallel one splits ``A`` along its input and keeps ``B`` whole,
so the base layer's own collective carries the adapter's share too and no other runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lit3d.config import GPTConfig

# Targets by role, and the module each names in a block (and in a HuggingFace Llama's, for PEFT's adapters).
ROLES = {
    "q": ("attn.q_proj", "self_attn.q_proj"),
    "k": ("attn.k_proj", "self_attn.k_proj"),
    "v": ("attn.v_proj", "self_attn.v_proj"),
    "o": ("attn.o_proj", "self_attn.o_proj"),
    "gate": ("mlp.gate_proj", "mlp.gate_proj"),
    "up": ("mlp.up_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj", "mlp.down_proj"),
}
ADAPTERS = ("lora_a", "lora_b")  # the parameter names of an adapter; every other parameter is frozen


@dataclass(frozen=True)
class LoRA:
    """Low-rank adapters (``--model.lora.rank=16`` on the command line).

    Args:
        rank: The adapters' inner width r.
        alpha: Their scale is ``alpha / rank`` (PEFT's ``lora_alpha``).
        dropout: Dropout on the adapters' input while training.
        targets: The linears that get one, by role: ``q``, ``k``, ``v``, ``o``, ``gate``, ``up``, ``down``.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "v")

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))  # (a list from YAML)
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"lora.rank={self.rank!r} must be a positive integer")
        if not self.alpha > 0 or not 0 <= self.dropout < 1:
            raise ValueError(f"lora.alpha={self.alpha!r} must be positive and lora.dropout={self.dropout!r} in [0, 1)")
        unknown = [t for t in self.targets if t not in ROLES]
        if unknown or not self.targets:
            raise ValueError(f"lora.targets={list(self.targets)!r}: {unknown or 'none'} not among {', '.join(ROLES)}")
        object.__setattr__(self, "targets", tuple(role for role in ROLES if role in self.targets))  # in block order

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def module_names(self) -> tuple[str, ...]:
        """The targeted modules' names inside a block (``attn.q_proj``, ...)."""
        return tuple(ROLES[t][0] for t in self.targets)


class LoRALinear(nn.Linear):
    """A linear with a low-rank adapter beside its weight (see the module's docstring)."""

    def __init__(self, in_features: int, out_features: int, lora: LoRA) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.lora_a = nn.Parameter(torch.empty(lora.rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(out_features, lora.rank))
        self.scaling = lora.scaling
        self.dropout = nn.Dropout(lora.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dropped = self.dropout(x) if self.dropout.p > 0 else x
        adapted = F.linear(F.linear(dropped, self.lora_a), self.lora_b)
        return F.linear(x, self.weight) + self.scaling * adapted


def linear(in_features: int, out_features: int, lora: LoRA | None, name: str) -> nn.Linear:
    """The linear a block builds as ``name`` (``attn.q_proj``): with an adapter where ``lora`` targets it."""
    if lora is not None and name in lora.module_names():
        return LoRALinear(in_features, out_features, lora)
    return nn.Linear(in_features, out_features, bias=False)


def init_adapter(name: str, tensor: torch.Tensor, generator: torch.Generator) -> bool:
    """Draw an adapter's start into ``tensor`` (whole) if ``name`` is one; False otherwise. ``A`` as PEFT draws it
    (Kaiming-uniform with a = √5: uniform in ±1/√in), ``B`` zero."""
    if name.endswith(".lora_a"):
        bound = 1 / math.sqrt(tensor.shape[1])
        tensor.uniform_(-bound, bound, generator=generator)
        return True
    if name.endswith(".lora_b"):
        tensor.zero_()
        return True
    return False


def freeze_all_but_adapters(network: nn.Module) -> None:
    """Only the adapters train: every other parameter gets no gradient and no optimizer state."""
    for name, param in network.named_parameters():
        param.requires_grad_(name.rsplit(".", 1)[-1] in ADAPTERS)


def check_lora(config: GPTConfig, lora: LoRA | None) -> None:
    """Refuse adapters on what has no plain linear to carry them: an MoE model's feed-forward (its experts are
    grouped weights)."""
    mlp = [t for t in (lora.targets if lora else ()) if t in ("gate", "up", "down")]
    if mlp and config.n_expert:
        raise ValueError(f"lora.targets={list(lora.targets)!r}: {mlp} on an MoE model's experts is not supported yet; "
                         "target the attention (q, k, v, o)")  # fmt: skip
