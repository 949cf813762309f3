"""The windowed-attention row of `benchmarks/gpu_check.py` (issue 66): lit3d's attention with a sliding window
(`lit3d.models.attention.causal_attention`, as gpt-oss's and Gemma 3's local layers call it) against a plain SDPA
given the same window as a full ``seq x seq`` boolean mask, and against causal attention without a window (what the
window could save), forward and backward, bf16 on a GPU (fp32 on CPU), the same q, k and v; and how far lit3d's
output is from the plain one's."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lit3d.models.attention import causal_attention
from lit3d.models.documents import window_mask

# gpt-oss's attention (64 query heads and 8 key/value heads of 64, a window of 128) at 8k tokens; tiny on CPU.
GPU_SHAPE = {"batch": 1, "seq": 8192, "heads": 64, "kv_heads": 8, "head_dim": 64, "window": 128}
CPU_SHAPE = {"batch": 1, "seq": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "window": 8}


def window_attention_run(settings: dict[str, Any]) -> dict[str, Any]:
    """Median forward + backward time of each way (``warmup`` then ``steps`` timed calls, at least 5), and the
    largest difference of lit3d's output from the plain SDPA's."""
    gpu = settings["accelerator"] == "gpu"
    shape, device = (GPU_SHAPE, torch.device("cuda")) if gpu else (CPU_SHAPE, torch.device("cpu"))
    dtype = torch.bfloat16 if gpu else torch.float32
    batch, seq, heads, kv_heads, width, window = (shape[k] for k in GPU_SHAPE)
    generator = torch.Generator(device=device).manual_seed(0)

    def tensor(n_heads: int) -> torch.Tensor:
        made = torch.randn(batch, seq, n_heads, width, device=device, dtype=dtype, generator=generator)
        return made.requires_grad_()

    q, k, v = tensor(heads), tensor(kv_heads), tensor(kv_heads)
    full_mask = window_mask(seq, window, device)  # (True: attends), the whole seq x seq of it

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        groups = heads // kv_heads  # (repeated: SDPA's kernels that take a mask take no grouped heads)
        k, v = (t.repeat_interleave(groups, dim=2).transpose(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, is_causal=mask is None)
        return out.transpose(1, 2)

    ways = {
        "lit3d_window": lambda: causal_attention(q, k, v, window=window),
        "sdpa_full_mask": lambda: plain(q, k, v, full_mask),
        "causal_no_window": lambda: plain(q, k, v, None),
    }
    repeats = max(5, settings["steps"])
    timed = {name: round(_median_s(call, settings["warmup"], repeats, device) * 1e3, 3) for name, call in ways.items()}
    with torch.no_grad():
        difference = (ways["lit3d_window"]() - ways["sdpa_full_mask"]()).abs().max().item()
    return {
        **shape,
        "dtype": str(dtype).removeprefix("torch."),
        "ms": timed,
        "over_full_mask": round(timed["sdpa_full_mask"] / timed["lit3d_window"], 3),
        "max_difference": difference,
    }


def _median_s(call: Callable[[], torch.Tensor], warmup: int, repeats: int, device: torch.device) -> float:
    """The median seconds of ``call()`` and a backward of its sum, after ``warmup`` untimed ones."""
    times = []
    for index in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        call().float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]
