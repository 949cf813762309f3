"""Fine-tuning's memory levers on one layout: full fine-tuning against LoRA and LoRA with CPU offload, in one run.

    python benchmarks/finetune.py                    # CPU: about a minute on 2 cores
    python benchmarks/finetune.py --rounds 5 --rank 8 --targets q v

Each configuration trains the same GPT (the embedded corpus, the same batches) at DP2 with ZeRO-3 on two processes:

    full            every weight trains (the baseline)
    lora            rank-16 adapters on every linear of the blocks, every other weight frozen
    lora+offload    the same, with ZeRO-3's shards, gradients and optimizer states in host memory

Printed per configuration: the peak memory of the most loaded rank, measured, beside the planner's (`lit3d plan`'s,
the run's own estimate); the median step time over interleaved rounds (A B C, B C A, ...; each round's median of
the steps after a warm-up) and its ratio against full fine-tuning measured in the same run.

Peak memory on GPUs is the allocator's peak; on CPU ranks it is the most bytes of live tensors over one step
(`lit3d.strategies.telemetry.live_memory`: what a GPU's allocator would hand out). On a CPU machine the host is the
device: offload moves nothing, so its measured peak is the planner's device peak plus its host memory, and its step time
shows only FSDP2's extra copies.
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

import lightning as L
import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (LoRA or not, Parallel3DStrategy kwargs)
CONFIGS = {
    "full": (False, {"zero_stage": 3}),
    "lora": (True, {"zero_stage": 3}),
    "lora+offload": (True, {"zero_stage": 3, "offload": True}),
}
BASELINE = "full"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per configuration and round")
    parser.add_argument("--warmup", type=int, default=4, help="steps before timing (the memory is measured in one)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16, help="LoRA's rank")
    parser.add_argument("--targets", nargs="+", default=["q", "k", "v", "o", "gate", "up", "down"])
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    started = time.time()
    threads = max(1, (os.cpu_count() or 2) // 2)
    results = run(args, threads)
    print(f"\nfine-tuning at DP2, ZeRO-3 ({'GPUs' if torch.cuda.is_available() else 'CPU processes'}), "
          f"{args.n_layer} layers of {args.d_model}, LoRA rank {args.rank} on {', '.join(args.targets)}")  # fmt: skip
    print(table(results))
    print(f"({time.time() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def table(results: dict[str, dict]) -> str:
    """The results as the markdown table docs/fine-tuning.md shows (MiB; on CPU ranks the measured peak holds the
    planned device peak and host memory both)."""
    lines = [
        "| configuration | peak, measured | planned: device | host | step time | vs full |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    base = results[BASELINE]["median_step_s"]
    for name, result in results.items():
        plan, mib = result["planned"], 2**20
        memory = f"{result['peak_bytes'] / mib:.1f} | {plan['total'] / mib:.1f} | {plan.get('host', 0) / mib:.1f}"
        step = result["median_step_s"]
        lines.append(f"| {name} | {memory} | {step * 1000:.0f} ms | {step / base:.2f} x |")
    return "\n".join(lines)


def run(args: argparse.Namespace, threads: int) -> dict[str, dict]:
    """Every configuration in one spawn of two ranks, interleaved over ``args.rounds`` rounds."""
    names = list(CONFIGS)
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        schedule = [(r, names[(r + i) % len(names)]) for r in range(args.rounds) for i in range(len(names))]
        mp.start_processes(_worker, args=(port, schedule, vars(args), threads, tmp), nprocs=2, start_method="spawn")
        results = {}
        for name in names:
            runs = [json.loads((Path(tmp) / f"{r}-{name}.json").read_text()) for r in range(args.rounds)]
            results[name] = {
                "median_step_s": statistics.median(run["median_step_s"] for run in runs),
                "per_round_s": [run["median_step_s"] for run in runs],
                "peak_bytes": runs[0]["measured_peak"],
                "planned": runs[0]["planned"],
            }
            print(f"  {name}: {results[name]['median_step_s'] * 1000:.1f} ms/step (rounds: "
                  f"{', '.join(f'{t * 1000:.0f}' for t in results[name]['per_round_s'])})", flush=True)  # fmt: skip
        return results


def _worker(rank: int, port: int, schedule: list, args: dict, threads: int, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      NODE_RANK="0", HF_DATASETS_DISABLE_PROGRESS_BARS="1")  # fmt: skip
    torch.set_num_threads(threads)
    import logging

    from benchmarks.step_timer import StepTimer
    from lit3d import GPT, GPTConfig, LoRA
    from lit3d.data import TextDataModule
    from lit3d.strategies import Parallel3DStrategy
    from lit3d.strategies.telemetry.live_memory import PeakMemory

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    gpu, d_model = torch.cuda.is_available(), args["d_model"]
    config = GPTConfig(n_layer=args["n_layer"], n_head=d_model // 64, n_kv_head=d_model // 128, d_model=d_model,
                       d_ff=int(2.75 * d_model), vocab_size=256, max_seq_len=args["seq_len"])  # fmt: skip
    for round_, name in schedule:
        adapted, strategy = CONFIGS[name]
        L.seed_everything(0, verbose=False)
        lora = LoRA(rank=args["rank"], alpha=2.0 * args["rank"], targets=tuple(args["targets"])) if adapted else None
        model = GPT(config, warmup_steps=2, lora=lora, optimizer_impl="foreach")
        data = TextDataModule(seq_len=args["seq_len"], global_batch_size=args["global_batch_size"])
        path = Path(tmp) / f"{round_}-{name}.json"
        callbacks = [StepTimer(str(path), warmup=args["warmup"])]
        if not gpu and round_ == 0:  # (the live tensors' bookkeeping slows its step: the timing leaves it out)
            callbacks.append(PeakMemory(step=args["warmup"] - 2))
        callbacks.append(PeakAndPlan(path, callbacks[1] if len(callbacks) > 1 else None))
        trainer = L.Trainer(accelerator="gpu" if gpu else "cpu", devices=2, strategy=Parallel3DStrategy(**strategy),
                            precision="bf16-mixed" if gpu else "32-true",
                            max_steps=args["steps"] + args["warmup"] + 1, callbacks=callbacks, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip
        trainer.fit(model, data)


class PeakAndPlan(L.Callback):
    """After `StepTimer` wrote ``path`` (rank 0), adds the most loaded rank's measured peak (the allocator's on GPUs,
    ``live``'s, a `PeakMemory`, on CPU ranks) and the planner's estimate of the run
    (`Parallel3DStrategy.memory_estimate`)."""

    def __init__(self, path: Path, live: L.Callback | None) -> None:
        self.path, self.live = path, live

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if torch.cuda.is_available():
            local = torch.cuda.max_memory_allocated()
        else:
            local = self.live.measured.get("peak", 0) if self.live is not None else 0
        peak = trainer.strategy.reduce(torch.tensor(float(local), device=pl_module.device), reduce_op="max")
        if trainer.is_global_zero:
            planned = {kind: int(value) for kind, value in trainer.strategy.memory_estimate.items()}
            result = {**json.loads(self.path.read_text()), "measured_peak": int(peak.item()), "planned": planned}
            self.path.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
