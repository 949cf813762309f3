"""The feed-forward layer of a dense block (a Mixture of Experts' shared expert too), and the gated activations it and
the experts compute (`gated`)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit3d.models.batch_context import NO_CONTEXT, BatchContext
from lit3d.models.config import GPTConfig
from lit3d.models.lora import LoRA, linear, project


class MLP(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x)), SwiGLU by default (`gated`)."""

    def __init__(self, config: GPTConfig, lora: LoRA | None = None) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = linear(config.d_model, config.d_ff, lora, "mlp.gate_proj", bias)
        self.up_proj = linear(config.d_model, config.d_ff, lora, "mlp.up_proj", bias)
        self.down_proj = linear(config.d_ff, config.d_model, lora, "mlp.down_proj", bias)
        self.act, self.limit, self.alpha = config.hidden_act, config.swiglu_limit, config.swiglu_alpha

    def forward(self, x: torch.Tensor, context: BatchContext = NO_CONTEXT) -> torch.Tensor:
        gate, up = project(self.gate_proj, x, context), project(self.up_proj, x, context)
        return project(self.down_proj, gated(gate, up, self.act, self.limit, self.alpha), context)


def gated(gate: torch.Tensor, up: torch.Tensor, act: str, limit: float | None, alpha: float) -> torch.Tensor:
    """A gated MLP's hidden state: ``silu(gate) · up`` (SwiGLU), ``gelu_tanh(gate) · up`` (Gemma's GeGLU), or with a
    ``limit`` gpt-oss's clamped SwiGLU: ``(clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)``, g = min(gate, limit)."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if act == "gelu_pytorch_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up
