"""Step time of lit3d's Parallel3DStrategy against Lightning's own strategies: same model, same data, same run.

    python benchmarks/strategies.py                  # CPU: about three minutes on 2 cores
    python benchmarks/strategies.py --rounds 5 --n-layer 8 --d-model 512

Every configuration trains the same GPT on the same batches (the embedded corpus). Configurations with the
same number of processes share one group of spawned processes and run in interleaved rounds (A B C, A B C, ...),
so slow phases of a shared machine hit all of them alike; a configuration's step time is the median, over
rounds, of the median wall time between optimizer steps after a warm-up. Each lit3d layout is printed as a
ratio against the Lightning strategy that does the same job, measured in this same run:

    Parallel3DStrategy 1x1x1          vs  auto (single device)
    Parallel3DStrategy DP, ZeRO-0/1   vs  ddp
    Parallel3DStrategy DP, ZeRO-3     vs  fsdp (Lightning's FSDP needs GPUs; skipped on CPU)

A ratio below 1 means lit3d is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (processes, strategy: a Lightning name or Parallel3DStrategy kwargs, baseline name)
CONFIGS = {
    "auto": (1, "auto", None),
    "3d 1x1x1": (1, {"zero_stage": 0}, "auto"),
    "ddp": (2, "ddp", None),
    "3d dp2 zero0": (2, {"zero_stage": 0}, "ddp"),
    "3d dp2 zero1": (2, {"zero_stage": 1}, "ddp"),
    "fsdp": (2, "fsdp", None),
    "3d dp2 zero3": (2, {"zero_stage": 3}, "fsdp"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every configuration")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--optimizer", default="auto", choices=["auto", "foreach", "fused"],
                        help="AdamW implementation (GPT.optimizer_impl), the same for every configuration")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), help=f"subset of: {', '.join(CONFIGS)}")
    parser.add_argument("--json", type=str, default=None, help="also write the results to this file")
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    cores = os.cpu_count() or 1
    print(f"model: n_layer={args.n_layer} d_model={args.d_model}, seq_len={args.seq_len}, global batch "
          f"{args.global_batch_size}, AdamW {args.optimizer}; {'GPU' if gpu else f'CPU, {cores} cores'}; "
          f"{args.rounds} rounds of {args.steps} steps", flush=True)
    results: dict[str, dict] = {}
    runnable: dict[int, list[str]] = {}
    for name in args.configs:
        processes, strategy, _ = CONFIGS[name]
        if strategy == "fsdp" and not gpu:
            results[name] = {"skipped": "Lightning's FSDPStrategy requires GPUs"}
        elif gpu and processes > torch.cuda.device_count():
            results[name] = {"skipped": f"needs {processes} GPUs"}
        else:
            runnable.setdefault(processes, []).append(name)
    started = time.time()
    for processes, names in runnable.items():
        results.update(run_group(processes, names, args, threads=max(1, cores // processes)))

    tokens = args.global_batch_size * args.seq_len
    print(f"\n{'configuration':<16}{'ms/step':>10}{'tokens/s':>11}{'mem MB':>10}   vs baseline (same run)")
    for name in args.configs:
        result = results[name]
        if "skipped" in result:
            print(f"{name:<16}{'-':>10}{'-':>11}{'-':>10}   skipped: {result['skipped']}")
            continue
        step, baseline = result["median_step_s"], CONFIGS[name][2]
        versus = ""
        if baseline and "median_step_s" in results.get(baseline, {}):
            result["ratio"] = step / results[baseline]["median_step_s"]
            versus = f"{result['ratio']:.3f} x {baseline}"
        elif baseline:
            versus = f"({baseline} not measured)"
        print(f"{name:<16}{step * 1000:>10.1f}{tokens / step:>11.0f}{result['peak_bytes'] / 2**20:>10.0f}   {versus}")
    print(f"({time.time() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def run_group(processes: int, names: list[str], args: argparse.Namespace, threads: int) -> dict[str, dict]:
    """All ``names`` (same process count) in one spawn, interleaved over ``args.rounds`` rounds."""
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        schedule = [(r, name) for r in range(args.rounds) for name in names]
        mp.start_processes(_worker, args=(processes, port, schedule, vars(args), threads, tmp),
                           nprocs=processes, start_method="spawn")
        results = {}
        for name in names:
            runs = [json.loads((Path(tmp) / f"{r}-{name}.json").read_text()) for r in range(args.rounds)]
            results[name] = {
                "median_step_s": statistics.median(run["median_step_s"] for run in runs),
                "per_round_s": [run["median_step_s"] for run in runs],
                "peak_bytes": max(run["peak_bytes"] for run in runs),
            }
            print(f"  {name}: {results[name]['median_step_s'] * 1000:.1f} ms/step "
                  f"(rounds: {', '.join(f'{t * 1000:.0f}' for t in results[name]['per_round_s'])})", flush=True)
        return results


def _worker(rank: int, processes: int, port: int, schedule: list, args: dict, threads: int, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(processes),
                      LOCAL_RANK=str(rank), NODE_RANK="0", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    torch.set_num_threads(threads)
    import logging

    import lightning as L

    from benchmarks.step_timer import StepTimer
    from lit3d import GPT, GPTConfig
    from lit3d.data import TextDataModule
    from strategies import Parallel3DStrategy

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    gpu = torch.cuda.is_available()
    d_model = args["d_model"]
    config = GPTConfig(n_layer=args["n_layer"], n_head=d_model // 32, n_kv_head=d_model // 64, d_model=d_model,
                       d_ff=3 * d_model, vocab_size=256, max_seq_len=args["seq_len"])
    for round_, name in schedule:
        strategy = CONFIGS[name][1]
        L.seed_everything(0, verbose=False)
        model = GPT(config, warmup_steps=2, optimizer_impl=args["optimizer"])
        data = TextDataModule(seq_len=args["seq_len"], global_batch_size=args["global_batch_size"])
        trainer = L.Trainer(
            accelerator="gpu" if gpu else "cpu", devices=processes,
            strategy=Parallel3DStrategy(**strategy) if isinstance(strategy, dict) else strategy,
            precision="bf16-mixed" if gpu else "32-true", max_steps=args["steps"] + args["warmup"] + 1,
            callbacks=[StepTimer(str(Path(tmp) / f"{round_}-{name}.json"), warmup=args["warmup"])], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0,
        )
        trainer.fit(model, data)


if __name__ == "__main__":
    main()
