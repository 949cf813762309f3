"""DiLoCo's islands against synchronous data parallelism on the embedded corpus: loss curves and bytes between islands.

    python benchmarks/diloco.py                       # CPU, 4 processes, about 5.5 minutes on 2 cores
    python benchmarks/diloco.py --steps 160 --png '' --json diloco.json

Every run trains the same GPT (the ``tiny`` preset) on the same global batches (the same tokens per step) on 4 CPU
processes: synchronous DP over all 4 replicas (ZeRO-1), and `Parallel3DStrategy(islands=2, sync_every=H)`, two
islands of DP2 (ZeRO-1 inside) that meet every H steps, once with DiLoCo's outer Nesterov step (lr 0.7, momentum
0.9, the paper's) and once with plain averaging (outer lr 1, no momentum). Each run measures the bytes each rank
sends per axis over H steps (`lit3d.callbacks.CommReport`, the mean per step), and a last, short run measures the
islands averaged every step (H=1) on the same mesh, the baseline whose bytes between islands H=8 divides. The
validation loss after the last step (a multiple of H, so the islands hold the same weights) is compared at equal
tokens; the picture shows the training curves.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=320, help="optimizer steps of each run (a multiple of H)")
    parser.add_argument("--sync-every", type=int, default=8, help="DiLoCo's H")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="the inner AdamW's peak learning rate")
    parser.add_argument("--png", default=str(ROOT / "docs" / "diloco_loss.png"), help="the picture ('' for none)")
    parser.add_argument("--json", default="", help="write the numbers here")
    args = parser.parse_args()
    if args.steps % args.sync_every:
        parser.error(f"--steps={args.steps} must be a multiple of --sync-every={args.sync_every}")
    h = args.sync_every
    runs = {
        "synchronous DP4": ({"zero_stage": 1}, args.steps),
        f"DiLoCo 2 islands x DP2, H={h}, outer lr 0.7, Nesterov 0.9": (
            {"zero_stage": 1, "islands": 2, "sync_every": h},
            args.steps,
        ),  # the paper's outer optimizer
        f"DiLoCo 2 islands x DP2, H={h}, outer lr 1, no momentum": (
            {"zero_stage": 1, "islands": 2, "sync_every": h, "outer_lr": 1.0, "outer_momentum": 0.0},
            args.steps,
        ),  # plain averaging every H steps (local SGD)
        "2 islands x DP2 averaged every step (H=1)": (
            {"zero_stage": 1, "islands": 2, "sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0},
            4 + 2 * h,
        ),
    }
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        # NOTE: forked, not spawned: the ranks start from this process, which has imported torch and Lightning (a
        # spawned rank imports them again: about 9 s of a core each on a small machine) and runs no thread of its own.
        mp.start_processes(_worker, args=(4, port, runs, vars(args), tmp), nprocs=4, start_method="fork")
        results = {name: json.loads((Path(tmp) / f"{i}.json").read_text()) for i, name in enumerate(runs)}
    report(results, h)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.png:
        draw(results, args, Path(args.png))


def report(results: dict[str, dict], h: int) -> None:
    sync, *diloco, every = results.values()
    print(f"{'run':<58}{'final val loss':>15}{'gap':>8}{'dp MiB/step':>13}{'island MiB/step':>16}{'planner':>9}")
    for name, r in results.items():
        val = f"{r['val_loss'][-1]:.4f}" if r is not every else "-"
        gap = f"{r['val_loss'][-1] / sync['val_loss'][-1] - 1:+.1%}" if r is not every else "-"
        m, p = r["measured"], r["planned"]
        print(f"{name:<58}{val:>15}{gap:>8}{m['dp'] / 2**20:>13.4f}{m.get('island', 0) / 2**20:>16.4f}"
              f"{p.get('island', 0) / 2**20:>9.4f}")  # fmt: skip
    island = diloco[0]["measured"]["island"]
    print(f"bytes between islands per step: H=1 / H={h} = {every['measured']['island'] / island:.2f}; "
          f"synchronous DP4's dp bytes / DiLoCo's island bytes = {sync['measured']['dp'] / island:.1f}")  # fmt: skip


def draw(results: dict[str, dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (name, r), colour in zip(list(results.items())[:3], ("tab:blue", "tab:orange", "tab:green")):
        steps, losses = zip(*r["train_loss"])
        smooth = [sum(losses[max(0, i - 9) : i + 1]) / len(losses[max(0, i - 9) : i + 1]) for i in range(len(losses))]
        ax.plot(steps, losses, color=colour, alpha=0.25, linewidth=0.8)
        ax.plot(steps, smooth, color=colour, label=f"{name}: train (mean of 10), val (dots)")
        ax.plot(r["val_steps"], r["val_loss"], "o--", color=colour)
    tokens = args.global_batch_size * args.seq_len
    ax.set_xlabel(f"optimizer step ({tokens:,} tokens each, the same batches in both runs)")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("tiny GPT on the standard library's source, 4 CPU processes", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, runs: dict, args: dict, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0", HF_DATASETS_DISABLE_PROGRESS_BARS="1")  # fmt: skip
    torch.set_num_threads(1)
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lit3d import GPT
    from lit3d.callbacks import CommReport
    from lit3d.data import TextDataModule
    from lit3d.strategies import Parallel3DStrategy

    h = args["sync_every"]
    for i, (strategy, steps) in enumerate(runs.values()):
        L.seed_everything(1234)
        model = GPT("tiny", learning_rate=args["learning_rate"], warmup_steps=20)
        data = TextDataModule(seq_len=args["seq_len"], global_batch_size=args["global_batch_size"])
        comm = CommReport(step=4, steps=h, verbose=False)
        logger = CSVLogger(tmp, name=f"run{i}", version=0)
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=Parallel3DStrategy(**strategy), max_steps=steps,
            val_check_interval=min(steps, 4 * h * max(1, steps // (16 * h))), limit_val_batches=8, logger=logger,
            log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, callbacks=[comm],
        )  # fmt: skip
        trainer.fit(model, data)
        if trainer.is_global_zero:
            rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
            train = [(int(r["step"]), float(r["train_loss"])) for r in rows if r.get("train_loss")]
            val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]
            result = {
                "train_loss": train, "val_steps": [s for s, _ in val], "val_loss": [v for _, v in val],
                "measured": comm.measured, "planned": comm.planned or {}, "steps": steps, "strategy": strategy,
            }  # fmt: skip
            (Path(tmp) / f"{i}.json").write_text(json.dumps(result))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
