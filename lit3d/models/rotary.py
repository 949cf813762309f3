"""Rotary position embeddings: the tables of cos and sin, their scaled variants, and the rotation.

The layout is HuggingFace Llama's rotate-half one. `Rope` is what a model's rotary embedding is (its base and its
scaling, as ``config.json`` names it); the tables are computed in fp32 once per rope, head width, device and dtype for
the longest sequence asked so far, and sliced.

Scalings (``rope_scaling`` / ``rope_parameters`` of a HuggingFace config):

- ``linear``: every frequency divided by ``factor`` (positions interpolated).
- ``llama3`` (Llama 3.1-3.3): frequencies whose wavelength is longer than ``original_max_position_embeddings /
  low_freq_factor`` are divided by ``factor``, those shorter than ``original_max_position_embeddings /
  high_freq_factor`` are kept, and those between are blended linearly in ``original / wavelength``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from lit3d.models.ring_attention import ContextParallel, positions


@dataclass(frozen=True)
class Rope:
    """A rotary embedding: its base ``theta`` and its ``scaling`` (``(name, value)`` pairs with ``rope_type``)."""

    theta: float = 10000.0
    scaling: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, theta: float, scaling: dict[str, Any] | None) -> Rope:
        return cls(float(theta), tuple(sorted((scaling or {}).items())))

    def inverse_frequencies(self, head_dim: int, device: torch.device) -> torch.Tensor:
        """``[head_dim / 2]`` angular frequencies, in fp32."""
        exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
        frequencies = 1.0 / self.theta**exponents
        scaling = dict(self.scaling)
        kind = scaling.get("rope_type")
        if kind == "linear":
            return frequencies / scaling["factor"]
        if kind == "llama3":
            return _llama3(frequencies, scaling)
        return frequencies


def _llama3(frequencies: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / frequencies
    blend = (original / wavelength - low) / (high - low)  # 0 at the long end of the band, 1 at its short end
    blended = (1 - blend) * frequencies / factor + blend * frequencies
    kept = torch.where(wavelength < original / high, frequencies, blended)
    return torch.where(wavelength > original / low, frequencies / factor, kept)


def rotary_tables(
    seq_len: int, head_dim: int, rope: Rope | float, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, ``[seq, head_dim]`` (``rope``: a `Rope`, or a plain base).

    Computed (in fp32, then cast to ``dtype``) once per (rope, head_dim, device, dtype) for the longest sequence
    asked so far, and sliced: not again in every block of every forward, and no cast copy kept for backward.
    """
    rope = rope if isinstance(rope, Rope) else Rope(float(rope))
    if torch.compiler.is_compiling():
        return tuple(t.to(dtype) for t in _rotary_tables(seq_len, head_dim, rope, device))
    key = (head_dim, rope, str(device), dtype)
    tables = _ROTARY_TABLES.get(key)
    if tables is None or tables[0].shape[0] < seq_len:
        # Plain tensors even under inference mode: training saves them for backward later.
        with torch.inference_mode(False), torch.no_grad():
            tables = tuple(t.to(dtype) for t in _rotary_tables(seq_len, head_dim, rope, device))
            _ROTARY_TABLES[key] = tables
    return tables[0][:seq_len], tables[1][:seq_len]


# NOTE: a memo, keyed by everything its tables are computed from (sizes, scaling, device, dtype, a CP rank's place): no
# run can make an entry stale, and a table is made once per process instead of at every forward.
_ROTARY_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def context_parallel_rotary_tables(
    cp: ContextParallel, seq_len: int, head_dim: int, rope: Rope | float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_tables` at the true positions of the ``seq_len`` tokens a CP rank holds (`lit3d.models.ring_attention`),
    cached the same way."""
    rope = rope if isinstance(rope, Rope) else Rope(float(rope))
    key = ("cp", seq_len, cp.size, cp.rank, head_dim, rope, str(device), dtype)
    compiling = torch.compiler.is_compiling()
    if compiling or key not in _ROTARY_TABLES:
        cos, sin = rotary_tables(seq_len * cp.size, head_dim, rope, device, dtype)
        where = positions(seq_len, cp.size, cp.rank, device)
        if compiling:
            return cos[where], sin[where]
        with torch.inference_mode(False), torch.no_grad():
            _ROTARY_TABLES[key] = cos[where], sin[where]
    return _ROTARY_TABLES[key]


def _rotary_tables(seq_len: int, head_dim: int, rope: Rope, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(
        torch.arange(seq_len, device=device, dtype=torch.float32), rope.inverse_frequencies(head_dim, device)
    )
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[batch, seq, heads, head_dim]`` by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    # [seq, head_dim], or [batch, seq, head_dim] for packed documents; no copy when the tables are in x's dtype
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    return x * cos + rotated * sin
