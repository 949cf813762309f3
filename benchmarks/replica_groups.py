"""What fault tolerance costs a step: replica groups on torchft against the same run without them, on CPU ranks.

    python benchmarks/replica_groups.py                  # 2 CPU processes, about 5 minutes on 2 cores
    python benchmarks/replica_groups.py --steps 40 --rounds 5

Every run trains the ``tiny`` GPT on the embedded corpus, the same global batches, 2 CPU processes, ZeRO-1:

- ``DP2``: one world of 2 ranks, data parallel (the baseline);
- ``DP2 as one replica group``: the same world as the one group of ``replica_groups=1``: a quorum and an average over
  the groups every step, with no second group to average with (the quorum's cost alone);
- ``2 replica groups of 1 rank``: two worlds of one rank, meeting through torchft (a quorum and the gradients'
  all-reduce over torchft's process group every step) in place of the world's own all-reduce;
- ``2 islands in one world, H=4``: DiLoCo's two islands of one rank in one world of 2 (the baseline of the next);
- ``2 replica groups as islands, H=4``: the same islands as two worlds meeting through torchft (a quorum and a
  one-float average as each round starts, the pseudo-gradients' all-reduce at its outer step).

The runs take turns in interleaved rounds; each run's step time is the median over its steps after the first few
(under DiLoCo, over every step: one in four carries the outer step), and the table prints each against its baseline's
median over the rounds. A lighthouse runs in this process.
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
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUNS = {  # name -> (worlds of ranks, replica_groups, DiLoCo's islands in one world and sync_every, baseline)
    "DP2": ([2], None, 1, 1, "DP2"),
    "DP2 as one replica group": ([2], 1, 1, 1, "DP2"),
    "2 replica groups of 1 rank": ([1, 1], 2, 1, 1, "DP2"),
    "2 islands in one world, H=4": ([2], None, 2, 4, "2 islands in one world, H=4"),
    "2 replica groups as islands, H=4": ([1, 1], 2, 1, 4, "2 islands in one world, H=4"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of each run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every run")
    parser.add_argument("--json", default="", help="write the numbers here")
    args = parser.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")
    # NOTE: one OpenMP thread in every thread of the ranks, as torchrun sets it. `torch.set_num_threads(1)` sets only
    # the calling thread's; torchft runs tensor ops in threads of its own, whose OpenMP team (as many as the cores)
    # then spins between regions beside the training thread: on 2 cores that took 2-3x a step of the groups' runs.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=5000)
    medians: dict[str, list[float]] = {name: [] for name in RUNS}
    try:
        for round_ in range(args.rounds):
            for name, (worlds, groups, islands, every, _) in RUNS.items():
                medians[name].append(run(worlds, groups, islands, every, args.steps, lighthouse.address()))
                print(f"round {round_ + 1}/{args.rounds}: {name}: {medians[name][-1] * 1e3:.1f} ms a step", flush=True)
    finally:
        lighthouse.shutdown()
    report(medians)
    if args.json:
        Path(args.json).write_text(json.dumps(medians, indent=2))


def run(worlds: list[int], groups: int | None, islands: int, every: int, steps: int, lighthouse: str) -> float:
    """One run: its worlds' ranks started together; the median step time of group 0's rank 0."""
    with tempfile.TemporaryDirectory() as tmp:
        ports = [_free_port() for _ in worlds]  # (each group its own world)
        plan = [(group, rank, world, ports[group]) for group, world in enumerate(worlds) for rank in range(world)]
        settings = (groups, islands, every)
        mp.start_processes(_rank, args=(plan, settings, steps, lighthouse, tmp), nprocs=len(plan), start_method="spawn")
        times = json.loads((Path(tmp) / "times.json").read_text())["times"]
    return statistics.median(times)


def _rank(index: int, plan: list, settings: tuple, steps: int, lighthouse: str, out: str) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lit3d import GPT, Parallel3DStrategy
    from lit3d.data.text import TextDataModule

    group, rank, world, port = plan[index]
    groups, islands, every = settings
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0", REPLICA_GROUP_ID=str(group), TORCHFT_LIGHTHOUSE=lighthouse)  # fmt: skip
    torch.set_num_threads(1)

    class Times(Callback):
        def __init__(self) -> None:
            self.times, self.last = [], None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            now = time.perf_counter()
            if self.last is not None and trainer.global_step > 3:  # (the first steps set up)
                self.times.append(now - self.last)
            self.last = now

        def on_train_end(self, trainer, pl_module) -> None:
            if group == 0 and rank == 0:
                (Path(out) / "times.json").write_text(json.dumps({"times": self.times}))

    L.seed_everything(1234)
    strategy = Parallel3DStrategy(zero_stage=1, replica_groups=groups, islands=islands, sync_every=every,
                                  timeout=timedelta(seconds=120))  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[Times()], default_root_dir=out)  # fmt: skip
    data = TextDataModule(seq_len=128, global_batch_size=8)
    trainer.fit(GPT("tiny", learning_rate=3e-3, warmup_steps=5, decay_steps=1000), data)


def report(medians: dict[str, list[float]]) -> None:
    print(f"\n{'run':<34}{'median ms/step':>16}{'ratio':>8}  against")
    for name, times in medians.items():
        baseline = RUNS[name][-1]
        median, base = statistics.median(times), statistics.median(medians[baseline])
        print(f"{name:<34}{median * 1e3:>16.1f}{median / base:>7.2f}x  {baseline}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
