"""Uneven work for uneven ranks, measured on this machine: one of two ranks slowed ``--slow`` times (a simulation of
a slower GPU kind), trained with the even split and with the fleet planner's uneven one, for pipeline (PP2) and data
(DP2) parallelism, in one run of interleaved rounds.

    python benchmarks/mixed_fleet.py                 # CPU: about two minutes on 2 cores
    python benchmarks/mixed_fleet.py --slow 3 --rounds 5

The simulation (`SlowBlocks`): on the slowed rank every decoder block, after its forward and after its backward,
sleeps ``slow - 1`` times what that pass took, so the rank runs its blocks ``slow`` times slower, as on a slower GPU,
without taking CPU time from the other rank. The embedding, head and optimizer are not slowed.

The uneven splits are `lit3d.planner.fleet`'s for a fleet of two CPU processes, the second with ``1 / slow`` of the
first's peak and memory bandwidth (`pipeline_option`, `data_option`); the even ones are the same runs with even
stages or shares.

Printed per pair: the median step time of each (interleaved rounds, medians of the steps after a warm-up), the
measured speedup of the uneven split over the even one, and the planner's predicted one (its step of the even split
over its step of the uneven one, the slowed rank priced on the slower device).
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


def planned(config, args: argparse.Namespace) -> tuple[dict[str, dict], dict[str, float]]:
    """The four runs and the planner's predicted speedup of each uneven split over the even one. The uneven splits are
    the fleet planner's (`lit3d.planner.fleet`) for this machine's CPU process and one ``slow`` times slower. The
    pipeline runs the schedule and micro-batches the planner chose; the replicas, its gradient accumulation."""
    from dataclasses import replace

    from lit3d.planner import Cluster, Request, estimate
    from lit3d.planner.fleet import data_option, pipeline_cluster, pipeline_option, replicas_option, shared_cluster
    from lit3d.planner.hardware import cpu_share

    fast = cpu_share(2)
    slow = replace(fast, name=f"CPU {args.slow:g}x slower", peak_tflops=fast.peak_tflops / args.slow,
                   memory_bandwidth_gbps=fast.memory_bandwidth_gbps / args.slow)  # fmt: skip
    groups = [Cluster.of(fast, 1, 1), Cluster.of(slow, 1, 1)]
    given = dict(tensor_parallel_size=1, activation_checkpointing=False, sequence_parallel=False,
                 precision="32-true", seq_len=args.seq_len, global_batch_size=args.global_batch_size)  # fmt: skip
    pipeline = pipeline_option(config, groups, Request.given(config, groups[0], zero_stage=0, **given)).candidate
    data = data_option(config, groups, Request.given(config, groups[0], zero_stage=1, **given))
    run = pipeline.parallelism
    schedule = {"pipeline_parallel_size": 2, "zero_stage": 0, "pipeline_schedule": run.pipeline_schedule,
                "num_microbatches": pipeline.plan.num_microbatches}  # fmt: skip
    accumulate = data.candidate.training.accumulate_grad_batches
    units = args.global_batch_size // accumulate  # the even split, in whole micro-batches as the uneven one
    even_shares = (units // 2 * accumulate, (units - units // 2) * accumulate)
    configs = {
        "pp2 even": schedule,
        "pp2 uneven": {**schedule, "pipeline_stage_layers": list(run.pipeline_stage_layers)},
        "dp2 even": {"zero_stage": 1, "accumulate": accumulate},
        "dp2 uneven": {"zero_stage": 1, "accumulate": accumulate,
                       "data_parallel_shares": list(data.candidate.parallelism.data_parallel_shares)},
    }  # fmt: skip
    cluster = pipeline_cluster(shared_cluster(groups), groups, 1)
    even = estimate(config, cluster, pipeline.layout, pipeline.training, replace(run, pipeline_stage_layers=None))
    base, settings = shared_cluster(groups), data.candidate.parallelism
    even_data = replicas_option(config, groups, base, data.candidate.layout, data.candidate.training,
                                replace(settings, data_parallel_shares=even_shares), accumulate)  # fmt: skip
    predicted = {"pp2": even.step_time_s / pipeline.plan.step_time_s,
                 "dp2": even_data.step_time_s / data.step_time_s}  # fmt: skip
    return configs, predicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slow", type=float, default=2.0, help="how many times slower rank 1 runs its blocks")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per configuration and round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch-size", type=int, default=12)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.slow < 1 or min(args.rounds, args.steps, args.n_layer, args.global_batch_size) < 1:
        parser.error("--slow must be at least 1, and --rounds, --steps, --n-layer, --global-batch-size positive")
    started = time.time()
    configs, predictions = planned(model_config(vars(args)), args)
    results = run(args, configs)
    print(f"\nrank 1 slowed {args.slow:g}x; {args.n_layer} blocks of {args.d_model}, global batch "
          f"{args.global_batch_size} x {args.seq_len}")  # fmt: skip
    print("| pair | even | uneven | split | measured speedup | predicted |\n|---|---:|---:|---|---:|---:|")
    for axis in ("pp2", "dp2"):
        even, uneven = results[f"{axis} even"], results[f"{axis} uneven"]
        uneven_run = configs[f"{axis} uneven"]
        split = (f"{uneven_run['pipeline_stage_layers']} blocks" if axis == "pp2"
                 else f"{uneven_run['data_parallel_shares']} samples")  # fmt: skip
        print(f"| {axis.upper()} | {even * 1000:.0f} ms | {uneven * 1000:.0f} ms | {split} | "
              f"{even / uneven:.2f} x | {predictions[axis]:.2f} x |")  # fmt: skip
    print(f"({time.time() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def run(args: argparse.Namespace, configs: dict[str, dict]) -> dict[str, float]:
    """Every configuration in one spawn of two ranks, interleaved over ``args.rounds`` rounds; median step times."""
    names = list(configs)
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        schedule = [(r, names[(r + i) % len(names)]) for r in range(args.rounds) for i in range(len(names))]
        mp.start_processes(_worker, args=(port, schedule, configs, vars(args), tmp), nprocs=2, start_method="spawn")
        results = {}
        for name in names:
            rounds = [json.loads((Path(tmp) / f"{r}-{name}.json").read_text())["median_step_s"]
                      for r in range(args.rounds)]  # fmt: skip
            results[name] = statistics.median(rounds)
            print(f"  {name}: {results[name] * 1000:.0f} ms/step (rounds: "
                  f"{', '.join(f'{t * 1000:.0f}' for t in rounds)})", flush=True)  # fmt: skip
        return results


class SlowBlocks(L.Callback):
    """On rank ``rank``: each decoder block sleeps ``factor - 1`` times its forward's and its backward's time after
    them, so that rank runs its blocks ``factor`` times slower (the simulated slower GPU)."""

    def __init__(self, rank: int, factor: float) -> None:
        self.rank, self.factor, self._hooks = rank, factor, []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank != self.rank or self.factor == 1:
            return
        for block in pl_module.model.blocks.values():
            self._hooks += [block.register_forward_pre_hook(self._start), block.register_forward_hook(self._stop),
                            block.register_full_backward_pre_hook(self._start),
                            block.register_full_backward_hook(self._stop)]  # fmt: skip

    def _start(self, module: torch.nn.Module, *_: object) -> None:
        module._slow_started = time.perf_counter()

    def _stop(self, module: torch.nn.Module, *_: object) -> None:
        time.sleep((self.factor - 1) * (time.perf_counter() - module._slow_started))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def model_config(args: dict):
    """The benchmark's model: ``n_layer`` blocks of ``d_model``, a byte vocabulary."""
    from lit3d import GPTConfig

    d_model = args["d_model"]
    return GPTConfig(n_layer=args["n_layer"], n_head=d_model // 64, n_kv_head=d_model // 128, d_model=d_model,
                     d_ff=int(2.75 * d_model), vocab_size=256, max_seq_len=args["seq_len"])  # fmt: skip


def _worker(rank: int, port: int, schedule: list, configs: dict, args: dict, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      NODE_RANK="0", HF_DATASETS_DISABLE_PROGRESS_BARS="1")  # fmt: skip
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    import logging

    from benchmarks.step_timer import StepTimer
    from lit3d import GPT
    from lit3d.data import TextDataModule
    from lit3d.strategies import Parallel3DStrategy

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    config = model_config(args)
    for round_, name in schedule:
        L.seed_everything(0, verbose=False)
        model = GPT(config, warmup_steps=2)
        data = TextDataModule(seq_len=args["seq_len"], global_batch_size=args["global_batch_size"])
        callbacks = [StepTimer(str(Path(tmp) / f"{round_}-{name}.json"), warmup=args["warmup"]),
                     SlowBlocks(rank=1, factor=args["slow"])]  # fmt: skip
        strategy = dict(configs[name])
        accumulate = strategy.pop("accumulate", 1)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=Parallel3DStrategy(**strategy),
                            accumulate_grad_batches=accumulate,
                            max_steps=args["steps"] + args["warmup"] + 1, callbacks=callbacks, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip
        trainer.fit(model, data)


if __name__ == "__main__":
    main()
