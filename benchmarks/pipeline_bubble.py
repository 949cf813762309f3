"""Measured pipeline bubble against theory, for p = 2, 4 stages and m = 2..16 micro-batches.

    python benchmarks/pipeline_bubble.py                      # synthetic stages, CPU, about two minutes
    python benchmarks/pipeline_bubble.py --schedules 1f1b gpipe interleaved_1f1b --timeline pp4_m8.png

Each stage is a block whose forward takes ``--forward-ms`` and whose backward takes twice that (it sleeps):
p processes on a small machine then do not compete for cores, so what is measured is the schedule itself,
run by lit3d's `lit3d.strategies.pipeline.Pipeline` on `torch.distributed.pipelining` (gloo). A stage's bubble is
the share of the step it spends not computing; the table shows the mean over stages next to the theory:
``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/(v·m+p-1)`` interleaved (v = 2 chunks per rank here).
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
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward take a fixed time (a stand-in for a block's compute)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(2 * ctx.seconds)
        return grad.clone(), None


class SleepBlock(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.scale, self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="*", default=[2, 4], help="pipeline sizes p")
    parser.add_argument("--microbatches", type=int, nargs="*", default=[2, 4, 8, 16], help="m values")
    parser.add_argument(
        "--schedules", nargs="*", default=["1f1b"], help="gpipe, 1f1b, interleaved_1f1b (2 chunks per rank)"
    )
    parser.add_argument("--forward-ms", type=float, default=20.0, help="forward time of one stage's micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per configuration (after one warm-up)")
    parser.add_argument(
        "--timeline",
        type=str,
        default="pipeline_timeline.png",
        help="picture of one step of the largest p with m=8 (empty: none)",
    )
    parser.add_argument("--json", type=str, default=None, help="also write the results to this file")
    args = parser.parse_args()

    from lit3d.strategies.pipeline import bubble_theory

    rows = []
    print(f"synthetic stages: forward {args.forward_ms:.0f} ms, backward {2 * args.forward_ms:.0f} ms per micro-batch")
    print(f"{'schedule':<18}{'p':>3}{'m':>4}{'measured':>10}{'theory':>9}{'step s':>9}")
    for schedule in args.schedules:
        for p in args.stages:
            for m in args.microbatches:
                virtual = 2 if schedule == "interleaved_1f1b" else 1
                if schedule == "1f1b" and m < p:
                    continue
                draw = args.timeline if (p == max(args.stages) and m == 8 and schedule == args.schedules[0]) else ""
                if draw and len(args.schedules) > 1:
                    draw = str(Path(draw).with_stem(f"{Path(draw).stem}_{schedule}"))
                result = measure(p, m, schedule, virtual, args.forward_ms / 1000 / virtual, args.steps, draw)
                theory = bubble_theory(schedule, p, m, virtual)
                rows.append(
                    {
                        "schedule": schedule,
                        "p": p,
                        "m": m,
                        "measured": result["bubble"],
                        "theory": theory,
                        "step_s": result["step_s"],
                    }
                )
                print(
                    f"{schedule:<18}{p:>3}{m:>4}{result['bubble']:>10.3f}{theory:>9.3f}{result['step_s']:>9.3f}",
                    flush=True,
                )
    if args.timeline:
        print(f"timeline of one step: {args.timeline}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def measure(p: int, m: int, schedule: str, virtual: int, seconds: float, steps: int, timeline: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(
            _worker, args=(p, port, m, schedule, virtual, seconds, steps, timeline, tmp), nprocs=p, start_method="spawn"
        )
        return json.loads((Path(tmp) / "result.json").read_text())


def _worker(
    rank: int,
    p: int,
    port: int,
    m: int,
    schedule: str,
    virtual: int,
    seconds: float,
    steps: int,
    timeline: str,
    tmp: str,
) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit3d.strategies.pipeline import Pipeline
    from lit3d.strategies.stages import chunk_stage_ids
    from lit3d.strategies.timeline import plot_timeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=p)
    mesh = init_device_mesh("cpu", (p,), mesh_dim_names=("pp",))
    stage_ids = chunk_stage_ids(rank, p, virtual)
    pipeline = Pipeline(
        [SleepBlock(seconds) for _ in stage_ids],
        stage_ids,
        p * virtual,
        mesh,
        schedule,
        m,
        torch.device("cpu"),
        loss_parallel=False,
    )
    inputs, targets = torch.ones(m, 4), torch.zeros(m, 4)
    bubbles, step_times, events = [], [], []
    for step in range(steps + 1):
        pipeline.loss(inputs, targets, lambda out, tgt: ((out - tgt) ** 2).mean())
        busy, total = pipeline.clock.busy(), pipeline.clock.step_seconds()
        every = [None] * p
        dist.all_gather_object(every, (busy, total, pipeline.clock.timeline()))
        if step > 0:  # the first step also infers shapes
            longest = max(t for _, t, _ in every)
            bubbles.append(statistics.mean(1 - b / longest for b, _, _ in every))
            step_times.append(longest)
            events = [e for _, _, rank_events in every for e in rank_events]
    if rank == 0:
        if timeline:
            plot_timeline(events, timeline, f"{schedule}: p={p}, m={m} (synthetic stages)", pipeline_ranks=p)
        result = {"bubble": statistics.median(bubbles), "step_s": statistics.median(step_times)}
        (Path(tmp) / "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
