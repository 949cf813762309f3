"""Causal attention backends: PyTorch SDPA, the flash-attn package, and a plain reference.

All take and return tensors laid out ``[batch, seq, heads, head_dim]``; keys and values may have fewer heads
than queries (grouped-query attention), and values another head width than queries and keys (latent attention: the
output has the values' width).
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F

from lit3d.models.documents import Documents, aligned_bias, window_mask


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend ``"auto"`` stands for on this device and dtype; checks that ``"flash"`` can run."""
    half = dtype in (torch.bfloat16, torch.float16)
    if backend == "auto":
        return "flash" if device.type == "cuda" and half and flash_attn_installed() else "sdpa"
    if backend == "flash":
        if not flash_attn_installed():
            raise RuntimeError("attention='flash' needs the flash-attn package: pip install 'lit3d[flash]'")
        if device.type != "cuda" or not half:
            raise RuntimeError(
                f"attention='flash' runs on CUDA in bf16/fp16, not on {device.type} in {dtype}; "
                "use attention='sdpa' or 'auto'"
            )
    return backend


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: str = "auto",
    documents: Documents | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ · scale + causal mask) v (``scale``: 1/√head_dim unless given), with the backend resolved for q's
    device and dtype; with packed ``documents``, each token attends only to its own document's; with a ``window``, only
    to the last ``window`` tokens (itself included); with ``sinks`` (one logit per head of q), each softmax's
    denominator gets ``exp(sink)`` more, which weighs no value (gpt-oss).

    NOTE: packed documents, sinks, and windows off flash-attn run PyTorch SDPA with a mask whatever the backend: on
    GPUs its memory-efficient kernel, which computes the masked blocks too (flash-attn's variable-length kernel would
    skip them; not wired yet). The mask is made once per forward and shared by its layers (`masked_attention`)."""
    backend = resolve_backend(backend, q.device, q.dtype)
    if documents is None and sinks is None and (window is None or backend == "flash"):
        return _causal(q, k, v, backend, window, scale)
    return masked_attention(q, k, v, attention_bias(q, documents, window, sinks is not None), sinks, scale)


def _causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, window: int | None, scale: float | None
) -> torch.Tensor:
    width, qk = v.shape[-1], q.shape[-1]
    scale = qk**-0.5 if scale is None else scale
    if backend == "flash":
        from flash_attn import flash_attn_func

        window_size = (-1, -1) if window is None else (window - 1, 0)  # (keys before, keys after)
        if width == qk:
            return flash_attn_func(q, k, v, causal=True, softmax_scale=scale, window_size=window_size)
        # NOTE: flash-attn takes one head width for q, k and v; latent attention's values are narrower (DeepSeek-V3:
        # 128 against 192). The narrower side is padded with zeros, which changes no score and no kept output column.
        full = max(width, qk)
        q, k, v = (F.pad(t, (0, full - t.shape[-1])) for t in (q, k, v))
        return flash_attn_func(q, k, v, causal=True, softmax_scale=scale, window_size=window_size)[..., :width]
    # NOTE: SDPA's fused kernels (flash on CPU and GPU) take one head width; with latent attention's narrower values
    # PyTorch would fall back to its math path, which keeps every head's seq x seq probabilities for backward. The
    # values are padded with zeros instead, as for flash-attn above: the same scores, the kept columns unchanged.
    if width < qk:
        v = F.pad(v, (0, qk - width))
    # SDPA wants [batch, heads, seq, head_dim].
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=True,
        enable_gqa=q.shape[2] != k.shape[2],
        scale=scale,
    )
    return out.transpose(1, 2)[..., :width]


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA with an additive ``bias`` (``[seq, seq]`` or ``[batch, 1, seq, seq]``: 0 where a query attends, -inf
    elsewhere); ``sinks`` join as one more key that every query sees, whose score is the sink and whose value is zero
    (``bias`` then has that key's column of zeros first).
    K/V heads are repeated per query group on GPUs (their kernel that takes a mask, the memory-efficient one, takes no
    grouped heads: SDPA would fall back to its math path, which keeps seq x seq probabilities), not on CPU (its flash
    kernel takes both).

    NOTE: SDPA takes no sink, so the sink rides on one more head coordinate: q gets ``sink / scale`` there, the sink's
    key 1 and every other key 0, so the sink's score is exactly ``sink`` and every other score is unchanged. Seven more
    zero coordinates keep the width a multiple of 8 for the fused kernels."""
    groups, (batch, seq, heads, width) = q.shape[2] // k.shape[2], q.shape
    if groups > 1 and q.device.type != "cpu":
        k, v = (t.repeat_interleave(groups, dim=2) for t in (k, v))
    scale, kept = width**-0.5 if scale is None else scale, v.shape[-1]
    if kept < width:  # (latent attention's narrower values, as in `_causal`)
        v = F.pad(v, (0, width - kept))
    if sinks is not None:
        column = (sinks.to(q.dtype) / scale).view(1, 1, heads, 1).expand(batch, seq, heads, 1)
        q = torch.cat((q, column, q.new_zeros(batch, seq, heads, 7)), dim=-1)
        kv_heads = k.shape[2]
        sink_key = k.new_zeros(batch, 1, kv_heads, width + 8)
        sink_key[..., width] = 1.0
        k = torch.cat((sink_key, F.pad(k, (0, 8))), dim=1)  # (first: a longer mask's corner serves shorter rows)
        v = torch.cat((v.new_zeros(batch, 1, kv_heads, width + 8), F.pad(v, (0, 8))), dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=bias,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)[..., :kept]


def attention_bias(
    q: torch.Tensor, documents: Documents | None, window: int | None, sink: bool = False
) -> torch.Tensor:
    """The additive causal mask of q's tokens (with the ``window`` and the ``documents``), in q's dtype, with the
    ``sink``'s column first."""
    if documents is not None:
        return documents.causal_bias(q.dtype, window, sink)
    return causal_bias(q.shape[1], window, q.device, q.dtype, sink)


def causal_bias(
    seq: int, window: int | None, device: torch.device, dtype: torch.dtype, sink: bool = False
) -> torch.Tensor:
    """``[seq, seq]``: 0 where a query sees a key (causally, within ``window``), -inf elsewhere, with a ``sink``'s
    column of zeros first; the corner of one mask per (window, device, dtype, sink), made for the longest sequence
    asked so far and shared by every layer and forward, as the rotary tables are."""
    key = (window, str(device), dtype, sink)
    made = _BIASES.get(key)
    if torch.compiler.is_compiling() or made is None or made.shape[0] < seq:
        made = aligned_bias(window_mask(seq, window or seq, device), dtype, sink)
        if torch.compiler.is_compiling():
            return made
        _BIASES[key] = made
    return made[:seq, : seq + sink]


# NOTE: a memo, keyed by everything a mask is made from but its size (as `lit3d.models.rotary`'s tables): no run can
# make an entry stale, every windowed layer of every forward shares one mask instead of keeping its own for backward,
# and a shorter sequence reads the corner of a longer one's, so it holds one mask per window and dtype at most.
_BIASES: dict[tuple, torch.Tensor] = {}


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """The textbook formula, for tests: no fused kernel, keys and values repeated per query group; a ``window`` and
    ``sinks`` as `causal_attention` takes them (the sink a first softmax column, dropped after)."""
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    seq = q.shape[1]
    seen = window_mask(seq, window or seq, q.device)
    scores = scores.masked_fill(seen.logical_not(), float("-inf"))
    if sinks is not None:
        scores = torch.cat((sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1), scores), dim=-1)
    weights = scores.softmax(dim=-1)[..., -seq:]
    return torch.einsum("bhqk,bkhd->bqhd", weights, v)
