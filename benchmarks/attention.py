"""Causal attention speed: flash-attn against PyTorch SDPA, forward + backward, same inputs, same run.

    python benchmarks/attention.py                      # on a CUDA GPU, bf16
    python benchmarks/attention.py --seq-len 8192 --heads 32 --kv-heads 8

Prints milliseconds per forward+backward and the ratio flash / sdpa (below 1: flash-attn is faster), and the
achieved attention TFLOP/s (4 · b · s² · h · d forward, x 3.5 with backward, halved for the causal mask).
Needs CUDA; flash-attn is skipped (with the reason) when not installed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lit3d.models.attention import causal_attention, flash_attn_installed


def time_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py needs a CUDA GPU (flash-attn runs only there)")
    shape = (args.batch, args.seq_len, args.heads, args.head_dim)
    kv_shape = (args.batch, args.seq_len, args.kv_heads, args.head_dim)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flops = 4 * args.batch * args.seq_len**2 * args.heads * args.head_dim * 3.5 / 2
    print(
        f"{torch.cuda.get_device_name()}: batch {args.batch}, seq {args.seq_len}, heads {args.heads}/{args.kv_heads}, "
        f"head_dim {args.head_dim}, bf16, forward + backward"
    )
    results = {}
    for backend in ("sdpa", "flash"):
        if backend == "flash" and not flash_attn_installed():
            print("flash: skipped (flash-attn is not installed: pip install -e '.[flash]')")
            continue
        ms = time_ms(lambda backend=backend: causal_attention(q, k, v, backend).sum().backward(), args.repeats)
        results[backend] = ms
        print(f"{backend:>6}: {ms:8.3f} ms  {flops / ms / 1e9:8.1f} TFLOP/s")
    if len(results) == 2:
        print(f"flash / sdpa (baseline) = {results['flash'] / results['sdpa']:.3f}")


if __name__ == "__main__":
    main()
