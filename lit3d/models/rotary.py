"""Rotary position embeddings: the tables of cos and sin, their scaled variants, and the rotation.

The layout is HuggingFace Llama's rotate-half one. `Rope` is what a model's rotary embedding is (its base and its
scaling, as ``config.json`` names it); the tables are computed in fp32 once per rope, head width, device and dtype for
the longest sequence asked so far, and sliced.

Scalings (``rope_scaling`` / ``rope_parameters`` of a HuggingFace config):

- ``linear``: every frequency divided by ``factor`` (positions interpolated).
- ``llama3`` (Llama 3.1-3.3): frequencies whose wavelength is longer than ``original_max_position_embeddings /
  low_freq_factor`` are divided by ``factor``, those shorter than ``original_max_position_embeddings /
  high_freq_factor`` are kept, and those between are blended linearly in ``original / wavelength``.
- ``yarn`` (YaRN, Peng et al. 2023; DeepSeek-V3, Kimi K2): frequencies that turn fewer than ``beta_slow`` times over
  ``original_max_position_embeddings`` are divided by ``factor``, those that turn more than ``beta_fast`` times are
  kept, and those between are blended linearly in their dim; cos and sin are scaled by an attention factor
  (``attention_factor``, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are given, else
  ``mscale(factor)``, with ``mscale(s, m) = 0.1 · m · ln s + 1``), as transformers computes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from lit3d.models.documents import Documents
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
        if kind == "yarn":
            return _yarn(frequencies, self.theta, head_dim, scaling)
        return frequencies

    def attention_factor(self) -> float:
        """What YaRN scales cos and sin by (1 for every other rotary embedding)."""
        scaling = dict(self.scaling)
        if scaling.get("rope_type") != "yarn":
            return 1.0
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        return yarn_mscale(factor)

    def softmax_correction(self) -> float:
        """DeepSeek's attention multiplies its softmax scale by ``mscale(factor, mscale_all_dim)²`` under YaRN with
        ``mscale_all_dim`` (the long-context temperature); 1 otherwise."""
        scaling = dict(self.scaling)
        if scaling.get("rope_type") != "yarn" or not scaling.get("mscale_all_dim"):
            return 1.0
        return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for positions stretched by ``factor``: ``0.1 · mscale · ln factor + 1``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(frequencies: torch.Tensor, theta: float, head_dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_turning(turns: float) -> float:  # the dim whose frequency turns ``turns`` times over the original context
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(scaling.get("beta_fast") or 32), dim_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device=frequencies.device)
    interpolated = ((dims - low) / (high - low if high != low else 0.001)).clamp(0, 1)  # 0: kept, 1: divided
    return frequencies / factor * interpolated + frequencies * (1 - interpolated)


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
    factor = rope.attention_factor()
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


def position_tables(
    rope: Rope,
    head_dim: int,
    x: torch.Tensor,
    documents: Documents | None,
    cp: ContextParallel | None,
    max_seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for the tokens of ``x`` ``[batch, seq, ...]``, in its dtype: with packed ``documents`` each token's
    by its position within its document (``[batch, seq, head_dim]``), under context parallelism by its true position,
    else by its place in the row (``[seq, head_dim]``)."""
    seq = x.shape[1]
    if documents is not None:
        tables = rotary_tables(max_seq_len, head_dim, rope, x.device, x.dtype)
        cos, sin = (t[documents.positions] for t in tables)
        return cos, sin
    if cp is None:
        return rotary_tables(seq, head_dim, rope, x.device, x.dtype)
    return context_parallel_rotary_tables(cp, seq, head_dim, rope, x.device, x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[batch, seq, heads, head_dim]`` by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    # [seq, head_dim], or [batch, seq, head_dim] for packed documents; no copy when the tables are in x's dtype
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    return x * cos + rotated * sin
