"""Measured pipeline bubble of every schedule against its theory, p = 2, 4 ranks and m = 2..16 micro-batches.

    python benchmarks/pipeline_bubble.py                           # all schedules, CPU, about five minutes
    python benchmarks/pipeline_bubble.py --stages 4 --microbatches 8 --schedules 1f1b zbv --timeline-dir docs

Each stage is a synthetic block whose forward, input gradient and weight gradient take ``--forward-ms``,
``--input-grad-ms`` and ``--weight-grad-ms`` (per micro-batch and rank, split over its chunks): the block's output
is the sum of an input path, whose backward is the input gradient, and a weight path fed a detached input, whose
backward is the weight gradient, so a zero-bubble schedule can run them apart as on a real layer. The blocks sleep
rather than compute: p processes on a small machine then do not compete for cores, and what is measured is the
schedule itself, run by lit3d's `lit3d.strategies.pipelining.step.Pipeline` on `torch.distributed.pipelining` (gloo).

Per configuration the table shows the measured bubble (the mean over ranks of the share of the step a rank does not
compute; median of ``--steps``), the theory of `lit3d.parallel.schedules` (the papers' formulas), and a replay of
PyTorch's own order of actions for that schedule with the same costs and free communication: where theory and replay
differ, the schedule's order leaves its paper's regime (too few micro-batches); where replay and measurement differ,
the runtime costs something. ``peak`` is the most micro-batches' activations a rank held at once (counted from
the timeline, forward to weight gradient) next to the theory's. ``--timeline-dir`` draws one step of each schedule
at the largest p and m = 8.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b:2", "zero_bubble:1", "zero_bubble:2", "zbv", "dualpipev"]


class _InputPath(torch.autograd.Function):
    """Identity whose forward takes ``forward_s`` and whose backward (the input gradient) takes ``input_s``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, input_s: float) -> torch.Tensor:
        ctx.input_s = input_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.input_s)
        return grad.clone(), None, None


class _WeightPath(torch.autograd.Function):
    """Zeros shaped like ``x`` that depend on ``weight`` only: its backward (the weight gradient) takes ``weight_s``."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, x: torch.Tensor, weight_s: float) -> torch.Tensor:
        ctx.weight_s = weight_s
        return torch.zeros_like(x) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.weight_s)
        return grad.sum().reshape(()), None, None


class SplitBlock(nn.Module):
    """A stage whose input and weight gradients are separate autograd paths with settable costs (seconds)."""

    def __init__(self, forward_s: float, input_s: float, weight_s: float) -> None:
        super().__init__()
        self.costs = (forward_s, input_s, weight_s)
        self.weight = nn.Parameter(torch.ones(()))
        self.input_gain = nn.Parameter(torch.ones(()))  # the first stage's embedding: its input needs a gradient too

    def forward(self, x: torch.Tensor, context=None) -> torch.Tensor:  # (the batch's context: nothing to read here)
        forward_s, input_s, weight_s = self.costs
        if not x.requires_grad:
            x = x * self.input_gain
        return _InputPath.apply(x, forward_s, input_s) + _WeightPath.apply(self.weight, x.detach(), weight_s)


def parse_schedule(token: str) -> tuple[str, int]:
    """``name`` or ``name:v`` (chunks per rank) -> (name, chunks)."""
    from lit3d.parallel.schedules import chunks_per_rank

    name, _, virtual = token.partition(":")
    return name, chunks_per_rank(name, int(virtual) if virtual else None)


def label(name: str, chunks: int) -> str:
    from lit3d.parallel.schedules import SCHEDULES

    return name if SCHEDULES[name].chunks == chunks else f"{name} v{chunks}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="*", default=[2, 4], help="pipeline sizes p")
    parser.add_argument("--microbatches", type=int, nargs="*", default=[2, 4, 8, 16], help="m values")
    parser.add_argument("--schedules", nargs="*", default=DEFAULT_SCHEDULES, help="name or name:chunks_per_rank")
    parser.add_argument("--forward-ms", type=float, default=20.0, help="forward of one micro-batch on one rank")
    parser.add_argument("--input-grad-ms", type=float, default=20.0, help="its input gradient")
    parser.add_argument("--weight-grad-ms", type=float, default=20.0, help="its weight gradient")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per configuration (after one warm-up)")
    parser.add_argument("--timeline-dir", type=str, default="", help="draw one step per schedule here (largest p, m=8)")
    parser.add_argument("--json", type=str, default=None, help="also write the results to this file")
    args = parser.parse_args()

    from lit3d.parallel.schedules import Costs

    schedules = [parse_schedule(token) for token in args.schedules]
    costs = Costs(args.forward_ms, args.input_grad_ms, args.weight_grad_ms)
    print(
        f"synthetic stages: forward {costs.forward:g} ms, input gradient {costs.input_grad:g} ms, weight gradient "
        f"{costs.weight_grad:g} ms per micro-batch and rank"
    )
    columns = {  # title: (row key, format)
        "schedule": ("schedule", "<20"), "p": ("p", ">3"), "m": ("m", ">4"), "measured": ("measured", ">10.3f"),
        "theory": ("theory", ">8.3f"), "replay": ("replay", ">8.3f"), "replay*": ("replay_measured", ">9.3f"),
        "pause ms": ("pause_ms", ">9.2f"), "peak": ("peak", ">6.2f"), "theory ": ("peak_theory", ">8.2f"),
        "step s": ("step_s", ">8.3f"),
    }  # fmt: skip
    print("".join(f"{title.strip():{fmt.rstrip('.23f')}}" for title, (_, fmt) in columns.items()))
    rows = []
    for p in args.stages:
        draw = args.timeline_dir if p == max(args.stages) else ""
        for row in measure(p, args.microbatches, schedules, costs, args.steps, draw):
            rows.append(row)
            print("".join(f"{row[key]:{fmt}}" for key, fmt in columns.values()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def measure(p: int, microbatches: list[int], schedules: list, costs, steps: int, timeline_dir: str) -> list[dict]:
    """Every schedule and micro-batch count on one spawned group of ``p`` ranks."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = (p, port, microbatches, schedules, costs, steps, timeline_dir, tmp)
        # NOTE: forked, not spawned: the ranks start from this process, which has imported torch and Lightning (a
        # spawned rank imports them again: about 9 s of a core each on a small machine) and runs no thread of its own.
        mp.start_processes(_worker, args=args, nprocs=p, start_method="fork")
        return json.loads((Path(tmp) / "result.json").read_text())


def _worker(rank, p, port, microbatches, schedules, costs, steps, timeline_dir, tmp) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.pipeline_replay import measured, nominal, order_of, replay
    from lit3d.parallel.schedules import SCHEDULES, bubble_theory, microbatch_problem, peak_in_flight
    from lit3d.parallel.stages import chunk_stage_ids
    from lit3d.strategies.pipelining.step import Pipeline
    from lit3d.strategies.pipelining.timeline import plot_timeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=p)
    mesh = init_device_mesh("cpu", (p,), mesh_dim_names=("pp",))
    rows = []
    for name, v in schedules:
        for m in microbatches:
            if microbatch_problem(p, name, m):
                continue
            placement = SCHEDULES[name].placement
            stage_ids = chunk_stage_ids(rank, p, v, placement)
            seconds = [c / 1000 / v for c in (costs.forward, costs.input_grad, costs.weight_grad)]
            blocks = [SplitBlock(*seconds) for _ in stage_ids]
            pipeline = Pipeline(blocks, stage_ids, p * v, mesh, name, m, torch.device("cpu"), loss_parallel=False)
            pipeline.clock.enabled = True
            inputs, targets = torch.ones(m, 4), torch.zeros(m, 4)
            bubbles, step_times, peaks, events = [], [], [], []
            for step in range(steps + 1):
                pipeline.loss(None, inputs, targets, lambda out, tgt: ((out - tgt) ** 2).mean())
                every = [None] * p
                dist.all_gather_object(every, (pipeline.clock.busy(), pipeline.clock.step_seconds(),
                                               pipeline.clock.timeline()))  # fmt: skip
                if step > 0:  # the first step also infers shapes
                    longest = max(t for _, t, _ in every)
                    bubbles.append(statistics.mean(1 - b / longest for b, _, _ in every))
                    step_times.append(longest)
                    peaks.append(max(held_at_peak(timeline, v) for _, _, timeline in every))
                    events = [e for _, _, rank_events in every for e in rank_events]
            if rank == 0:
                order = order_of(pipeline.schedule, name, p, m)
                chunk_costs = [c / 1000 / v for c in (costs.forward, costs.input_grad, costs.weight_grad)]
                as_measured, pause = measured(events, p, placement)
                rows.append({
                    "schedule": label(name, v), "name": name, "chunks": v, "p": p, "m": m,
                    "measured": statistics.median(bubbles), "theory": bubble_theory(name, p, m, v, costs),
                    "replay": replay(order, p * v, nominal(*chunk_costs))[0],
                    "replay_measured": replay(order, p * v, as_measured, pause)[0], "pause_ms": 1000 * pause,
                    "peak": max(peaks), "peak_theory": max(peak_in_flight(name, p, m, v, r) for r in range(p)),
                    "step_s": statistics.median(step_times),
                })  # fmt: skip
                if timeline_dir and m == 8:
                    path = Path(timeline_dir) / f"pipeline_{label(name, v).replace(' ', '_')}_p{p}_m{m}.png"
                    title = f"{label(name, v)}: p={p}, m={m}, F = B = W (synthetic stages; bubble {bubbles[-1]:.3f})"
                    plot_timeline(events, path, title, pipeline_ranks=p, placement=placement)
            dist.barrier()
    if rank == 0:
        (Path(tmp) / "result.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def held_at_peak(events: list[tuple[int, str, int, float, float]], chunks: int) -> float:
    """The most micro-batches (in whole ranks' layers) whose activations one rank held at once: a chunk's are held
    from its forward to the end of its backward (its weight gradient when that runs apart)."""
    last = {}
    for stage, kind, mb, _, end in events:
        if kind in ("B", "W"):
            last[stage, mb] = max(last.get((stage, mb), 0.0), end)
    changes = sorted(
        [(start, 1) for stage, kind, _, start, _ in events if kind == "F"] + [(t, -1) for t in last.values()]
    )
    held = peak = 0
    for _, change in changes:
        held += change
        peak = max(peak, held)
    return peak / chunks


if __name__ == "__main__":
    main()
