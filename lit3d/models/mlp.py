"""The feed-forward layer of a dense block (a Mixture of Experts' shared expert too)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit3d.models.batch_context import NO_CONTEXT, BatchContext
from lit3d.models.config import GPTConfig
from lit3d.models.lora import LoRA, linear, project


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: GPTConfig, lora: LoRA | None = None) -> None:
        super().__init__()
        self.gate_proj = linear(config.d_model, config.d_ff, lora, "mlp.gate_proj")
        self.up_proj = linear(config.d_model, config.d_ff, lora, "mlp.up_proj")
        self.down_proj = linear(config.d_ff, config.d_model, lora, "mlp.down_proj")

    def forward(self, x: torch.Tensor, context: BatchContext = NO_CONTEXT) -> torch.Tensor:
        hidden = F.silu(project(self.gate_proj, x, context)) * project(self.up_proj, x, context)
        return project(self.down_proj, hidden, context)
