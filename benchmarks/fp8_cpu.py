"""FP8 on CPU against bf16: the step time of ``Parallel3DStrategy(float8=...)`` on one process, rowwise and tensorwise,
against the same run in bf16-mixed, at the shape of issue 69 (a 4-block d_model 128 GPT, sequences of 64, global
batch 8).

    python benchmarks/fp8_cpu.py                                            # under 2 minutes, on one thread
    LIT3D_FLOAT8_CPU_MATMUL=scaled_mm python benchmarks/fp8_cpu.py --rounds 1 --steps 2    # PyTorch's _scaled_mm

On CPU the FP8 matmuls run as torchao's emulation unless ``LIT3D_FLOAT8_CPU_MATMUL=scaled_mm`` asks for PyTorch's CPU
``_scaled_mm`` (`lit3d.strategies.split.float8`); the header says which. The three runs share one spawned process
and go in interleaved rounds (`benchmarks.strategies.run_group`: each round starts one run later), each step time the
median over rounds of a run's median step after the warm-up; printed with each FP8 run's ratio to bf16's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.strategies import run_group  # noqa: E402
from lit3d.strategies.split.float8 import CPU_MATMUL, cpu_matmul  # noqa: E402

RUNS = {"bf16-mixed": "3d 1x1x1", "fp8 rowwise": "3d 1x1x1 fp8 rowwise", "fp8 tensorwise": "3d 1x1x1 fp8"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repetitions of every run")
    parser.add_argument("--steps", type=int, default=8, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (one: steadier when shared)")
    args = parser.parse_args()
    if min(args.rounds, args.steps, args.threads, args.n_layer, args.d_model, args.seq_len, args.global_batch_size) < 1:
        parser.error("--rounds, --steps, --threads and the shape must be at least 1")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first step pays for setup)")
    # what `benchmarks.strategies`' workers read: every run in bf16-mixed, a dense model, AdamW as it defaults
    args.float8, args.experts, args.optimizer = True, 0, "auto"
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # (else the strategy sets torch's threads to the cores)
    print(
        f"model: n_layer={args.n_layer} d_model={args.d_model}, seq_len={args.seq_len}, global batch "
        f"{args.global_batch_size}; one process, {args.threads} of {os.cpu_count()} CPU cores; {args.rounds} rounds "
        f"of {args.steps} steps; "
        f"FP8 matmuls: {cpu_matmul()} ({CPU_MATMUL})",
        flush=True,
    )
    started = time.time()
    results = run_group(1, list(RUNS.values()), args, threads=args.threads)
    bf16 = results[RUNS["bf16-mixed"]]["median_step_s"]
    print(f"\n{'run':<16}{'ms/step':>10}   against bf16-mixed (medians, same run)")
    for name, config in RUNS.items():
        step = results[config]["median_step_s"]
        print(f"{name:<16}{step * 1000:>10.1f}   {step / bf16:.2f} x")
    print(f"({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
