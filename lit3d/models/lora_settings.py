"""What LoRA is asked for (`LoRA`) and the roles it targets: plain values, no torch (the planner reads them too)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Targets by role, and the module each names in a block (and in a HuggingFace Llama's, for PEFT's adapters).
ROLES = {
    "q": ("attn.q_proj", "self_attn.q_proj"),
    "k": ("attn.k_proj", "self_attn.k_proj"),
    "v": ("attn.v_proj", "self_attn.v_proj"),
    "o": ("attn.o_proj", "self_attn.o_proj"),
    "q_a": ("attn.q_a_proj", "self_attn.q_a_proj"),  # multi-head latent attention's (`lit3d.models.latent_attention`)
    "q_b": ("attn.q_b_proj", "self_attn.q_b_proj"),
    "kv_a": ("attn.kv_a_proj_with_mqa", "self_attn.kv_a_proj_with_mqa"),
    "kv_b": ("attn.kv_b_proj", "self_attn.kv_b_proj"),
    "gate": ("mlp.gate_proj", "mlp.gate_proj"),
    "up": ("mlp.up_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj", "mlp.down_proj"),
}
ADAPTERS = ("lora_a", "lora_b")  # the parameter names of an adapter; every other parameter is frozen
MLP_ROLES = ("gate", "up", "down")  # a dense MLP's, and an MoE layer's experts'


def model_roles(config: Any) -> tuple[str, ...]:
    """The roles a model of ``config`` (a `lit3d.GPTConfig`) has a linear for, in block order."""
    if config.kv_lora_rank is None:
        return ("q", "k", "v", "o", *MLP_ROLES)
    queries = ("q",) if config.q_lora_rank is None else ("q_a", "q_b")
    return (*queries, "kv_a", "kv_b", "o", *MLP_ROLES)


@dataclass(frozen=True)
class LoRA:
    """Low-rank adapters (``--model.lora.rank=16`` on the command line).

    Args:
        rank: The adapters' inner width r.
        alpha: Their scale is ``alpha / rank`` (PEFT's ``lora_alpha``).
        dropout: Dropout on the adapters' input while training; its masks are the same in every layout (drawn from
            each element's place in the run: `lit3d.models.lora_dropout`).
        targets: The linears that get one, by role: ``q``, ``k``, ``v``, ``o``, ``gate``, ``up``, ``down``; under
            multi-head latent attention ``q`` (without ``q_lora_rank``), ``q_a``, ``q_b``, ``kv_a``, ``kv_b`` and
            ``o``.
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

    def check_model(self, config: Any) -> None:
        """Refuse targets a model of ``config`` (a `lit3d.GPTConfig`) has no linear for, naming them and those it
        has: latent attention has no ``k`` or ``v`` projection, and ``q`` only without a ``q_lora_rank``."""
        roles = model_roles(config)
        missing = [t for t in self.targets if t not in roles]
        if missing:
            raise ValueError(
                f"lora.targets={list(self.targets)!r}: {config.family} has no {', '.join(missing)} linear "
                f"(its targets: {', '.join(roles)})"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def module_names(self) -> tuple[str, ...]:
        """The targeted modules' names inside a block (``attn.q_proj``, ...)."""
        return tuple(ROLES[t][0] for t in self.targets)
