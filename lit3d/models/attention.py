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

from lit3d.models.documents import Documents


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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto", documents: Documents | None = None
) -> torch.Tensor:
    """softmax(q kᵀ / √d + causal mask) v, with the backend resolved for q's device and dtype; with packed
    ``documents``, each token attends only to its own document's.

    NOTE: packed documents run PyTorch SDPA with a block-diagonal mask whatever the backend: on GPUs its
    memory-efficient kernel, which computes the masked blocks too (flash-attn's variable-length kernel would skip
    them; not wired yet)."""
    if documents is not None:  # K/V heads repeated: SDPA's kernels that take a mask take no grouped heads
        groups = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(groups, dim=2) if groups > 1 else t for t in (k, v))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=documents.causal_bias(q.dtype)
        )
        return out.transpose(1, 2)
    backend = resolve_backend(backend, q.device, q.dtype)
    if backend == "flash":
        from flash_attn import flash_attn_func

        width, qk = v.shape[-1], q.shape[-1]
        if width == qk:
            return flash_attn_func(q, k, v, causal=True)
        # NOTE: flash-attn takes one head width for q, k and v; latent attention's values are narrower (DeepSeek-V3:
        # 128 against 192). The narrower side is padded with zeros, which changes no score and no kept output column.
        full = max(width, qk)
        q, k, v = (F.pad(t, (0, full - t.shape[-1])) for t in (q, k, v))
        return flash_attn_func(q, k, v, causal=True, softmax_scale=qk**-0.5)[..., :width]
    # NOTE: SDPA's fused kernels (flash on CPU and GPU) take one head width; with latent attention's narrower values
    # PyTorch would fall back to its math path, which keeps every head's seq x seq probabilities for backward. The
    # values are padded with zeros instead, as for flash-attn above: the same scores, the kept columns unchanged.
    width, qk = v.shape[-1], q.shape[-1]
    if width < qk:
        v = F.pad(v, (0, qk - width))
    # SDPA wants [batch, heads, seq, head_dim].
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=q.shape[2] != k.shape[2]
    )
    return out.transpose(1, 2)[..., :width]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The textbook formula, for tests: no fused kernel, keys and values repeated per query group."""
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    seq = q.shape[1]
    future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", weights, v)
