"""The RMSNorms of a block: PyTorch's, or Gemma's, which scales by ``1 + weight`` in fp32 (`rms_norm` picks)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit3d.models.config import GPTConfig


class UnitOffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) · (1 + weight)``, computed in fp32 and cast back to x's dtype; the weight starts
    at 0 (the identity scale)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def rms_norm(width: int, config: GPTConfig) -> nn.Module:
    """The RMSNorm of ``config``'s family over ``width`` features (`GPTConfig.norm_unit_offset`)."""
    if config.norm_unit_offset:
        return UnitOffsetRMSNorm(width, config.norm_eps)
    return nn.RMSNorm(width, eps=config.norm_eps)
