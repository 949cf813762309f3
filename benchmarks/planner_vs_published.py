"""The planner's clock against published training runs of 11 source groups: tokens/s per GPU or MFU, planned beside
published, judged by its fit and by leave-one-source-out; and whether each run plans as fitting its card.

    python benchmarks/planner_vs_published.py             # every run with the shipped constants (a second)
    python benchmarks/planner_vs_published.py --loso      # and the fit's and leave-one-source-out's (20 s, 2 cores)
    python benchmarks/planner_vs_published.py --fit       # the constants the fit chooses on every run
    python benchmarks/planner_vs_published.py --markdown  # the tables of benchmarks/README.md

Each run (`benchmarks/published_runs.py`, `benchmarks/published_sources.py`) is planned as published: its model, GPUs,
links and power cap, sequence length, batches, layout, recompute and how its stack's kernels are written
(`lit3d.planner.inputs.Software`, set from what the source states or its framework's documented default), with
`lit3d.planner.plan` on the fixed layout. The ratio is predicted / published, in the unit the source publishes.

The ratio is printed with the shipped constants of `lit3d.planner.calibration`; ``--fit`` and ``--loso`` also fit the
fitted ones (`FITTED`: Hopper's GEMM efficiency and its inner-dimension shape, the cost of overlapped communication,
the host's time per step) on a grid, minimising the mean |log ratio| with each source group weighing the same, on
every run (the fit's error) and on every group but one, predicting that one, for each group in turn
(leave-one-source-out): each run is planned once per grid point, then every fold is arithmetic over those plans.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
from dataclasses import replace
from multiprocessing import Pool
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.published_runs import CALIBRATION, HELD_OUT, Run
from benchmarks.published_sources import OTHER_SOURCES
from lit3d.planner import Cluster, Plan, Request, Training, plan
from lit3d.planner.calibration import HOPPER
from lit3d.planner.hardware import GPU, GPUS

RUNS = [*CALIBRATION, *HELD_OUT, *OTHER_SOURCES]
# The kinds the breakdown has, printed largest first.
KINDS = ("compute", "memory_bound", "communication", "bubble", "optimizer", "overhead")
# The fitted constants of Hopper (and Blackwell, which takes Hopper's numbers) and the values the fit tries; the host's
# time per step (``step_overhead_ms``) adds to the step, so its values cost no plan.
FITTED = {
    "gemm": [round(0.6 + 0.025 * i, 3) for i in range(11)],
    "gemm_half_dim": [0.0, 50.0, 100.0, 150.0, 175.0, 200.0],
    "overlap_cost": [0.0, 0.125, 0.25, 0.5],
}
OVERHEADS_MS = [10.0 * i for i in range(21)]


# What a published run is planned with of its card's memory kept free: none. A run that trained shows that its card
# held its peak, not what its allocator left free; lit3d keeps `Training.headroom` (10 %) free by default for its own
# launches, and `memory` prints the runs planned above that beside their reason.
PUBLISHED_HEADROOM = 0.0
# The runs that trained and plan above the 90 % of their card that lit3d's default leaves a layout, and why.
TIGHT = "within the card's memory, not the 10 % of it the planner keeps free by default"
MEMORY_GAPS = {
    "Llama 3 70B, FSDP64, 64 GB200, FP8 (Bridge 25.11)": (
        f"{TIGHT}: with 40 of its 80 blocks offloaded as its config states, the other 40 keep 3.9 GB each for "
        "2 x 8,192 tokens; the embedding and the head stay gathered through the step with their gradients (8.4 GB), "
        "as lit3d's FSDP2 root keeps them and as Megatron-FSDP keeps the modules outside its units (the blocks)"
    ),
}


def predict(run: Run, constants: dict[str, float] | None = None, headroom: float = PUBLISHED_HEADROOM) -> Plan:
    """The planner's plan of ``run`` as published, with Hopper's fitted ``constants`` replaced (`FITTED`) and
    ``headroom`` of its card kept free."""
    settings = dict(run.cluster)
    settings.pop("gpu", None)
    cluster = Cluster.of(run_gpu(run), max(1, run.gpus // 8), min(8, run.gpus), **settings)
    if constants and cluster.gpu.efficiency is HOPPER:
        cluster = replace(cluster, gpu=replace(cluster.gpu, efficiency=replace(HOPPER, **constants)))
    given = {"precision": "bf16-mixed", "headroom": headroom, **run.layout, **run.loop}
    return plan(Request.given(run.model, cluster, **given)).chosen.plan


def ratio(run: Run, predicted: Plan) -> float:
    value = predicted.tokens_per_s_per_gpu if run.unit == "tokens" else predicted.mfu
    return value / run.measured


def shares(predicted: Plan) -> dict[str, float]:
    """The step's seconds by kind, as shares of it (communication: all axes' exposed time)."""
    breakdown = predicted.time_breakdown
    seconds = {kind: breakdown.get(kind, 0.0) for kind in KINDS}
    seconds["communication"] = sum(breakdown["exposed_communication"].values())
    return {kind: value / predicted.step_time_s for kind, value in seconds.items()}


def _grid_row(run: Run) -> tuple[list[float], list[float]]:
    """(ratio, step seconds) of ``run`` at every point of `FITTED` (one plan where the run is not on Hopper)."""
    points = [dict(zip(FITTED, values)) for values in itertools.product(*FITTED.values())]
    if _fitted_device(run) is not HOPPER:
        alone = predict(run)
        return [ratio(run, alone)] * len(points), [alone.step_time_s] * len(points)
    plans = [predict(run, point) for point in points]
    return [ratio(run, p) for p in plans], [p.step_time_s for p in plans]


def run_gpu(run: Run) -> GPU:
    """The card ``run`` ran on (an H100 where its source's cluster names none)."""
    return run.cluster.get("gpu", GPUS["H100"])


def _fitted_device(run: Run):
    return run_gpu(run).efficiency


# How much each run weighs in a fit, by the number of runs of its group: every group the same (the default), every
# run the same, or between the two.
WEIGHTINGS = {"group": lambda n: 1 / n, "run": lambda n: 1.0, "sqrt": lambda n: 1 / math.sqrt(n)}


class Grid:
    """Every run's ratio at every point of `FITTED` x `OVERHEADS_MS`, and the fits it allows."""

    def __init__(self, runs: list[Run], processes: int = 2, weighting: str = "group"):
        with Pool(processes) as pool:
            rows = pool.map(_grid_row, runs)
        self.runs = runs
        ratios, steps = (np.array([row[i] for row in rows]).T for i in (0, 1))  # (points, runs)
        shipped = np.array([HOPPER.step_overhead_ms if _fitted_device(r) is HOPPER else math.nan for r in runs])
        overheads = np.array(OVERHEADS_MS)[:, None, None]
        # A step's tokens/s and MFU go as 1 / step: the host's time replaced where the run is on Hopper.
        on_hopper = ~np.isnan(shipped)
        changed = steps + np.where(on_hopper, (overheads - np.nan_to_num(shipped)) * 1e-3, 0.0)
        self.logs = np.log(ratios * steps / changed)  # (overheads, points, runs)
        groups = [run.source_group for run in runs]
        self.groups = groups
        self.weights = np.array([WEIGHTINGS[weighting](groups.count(g)) for g in groups])

    def best(self, keep: np.ndarray) -> tuple[int, int]:
        """(overhead, point) indices minimising the weighted mean |log ratio| over the runs in ``keep``."""
        loss = (np.abs(self.logs[:, :, keep]) * self.weights[keep]).sum(axis=2)
        return np.unravel_index(np.argmin(loss), loss.shape)

    def constants(self, index: tuple[int, int]) -> dict[str, float]:
        points = list(itertools.product(*FITTED.values()))
        return dict(zip(FITTED, points[index[1]])) | {"step_overhead_ms": OVERHEADS_MS[index[0]]}

    def fitted(self) -> tuple[dict[str, float], np.ndarray]:
        """The constants fitted on every run, and each run's ratio with them."""
        index = self.best(np.ones(len(self.runs), bool))
        return self.constants(index), np.exp(self.logs[index[0], index[1]])

    def left_out(self) -> tuple[np.ndarray, dict[str, dict[str, float]]]:
        """Each run's ratio with the constants fitted on every other group; the constants of each fold."""
        ratios, folds = np.zeros(len(self.runs)), {}
        for group in dict.fromkeys(self.groups):
            inside = np.array([g == group for g in self.groups])
            index = self.best(~inside)
            ratios[inside] = np.exp(self.logs[index[0], index[1], inside])
            folds[group] = self.constants(index)
        return ratios, folds


def row(run: Run, predicted: Plan, left_out: float | None, markdown: bool) -> str:
    measured = f"{run.measured:,.0f} tok/s" if run.unit == "tokens" else f"{run.measured:.0%} MFU"
    mine = f"{predicted.tokens_per_s_per_gpu:,.0f} tok/s" if run.unit == "tokens" else f"{predicted.mfu:.1%} MFU"
    split = shares(predicted)
    largest = ", ".join(f"{kind} {split[kind]:.0%}" for kind in sorted(split, key=split.get, reverse=True)[:2])
    loso = "" if left_out is None else f"{left_out:.3f}"
    cells = (run.name, f"{run.gpus:,}", measured, mine, f"{ratio(run, predicted):.3f}", loso, largest)
    if markdown:
        return "| " + " | ".join(cells) + " |"
    return f"{cells[0]:<50}{cells[1]:>7}{cells[2]:>15}{cells[3]:>16}{cells[4]:>8}{cells[5]:>8}  {cells[6]}"


HEADER = ("run", "GPUs", "published", "planner", "ratio", "LOSO", "largest shares of the step")


def report(runs: list[Run], markdown: bool, left_out: dict[str, float] | None = None) -> list[float]:
    """Every run of ``runs`` by source group, planned with the shipped constants (its ratio) and, where given, with
    the constants fitted without its group (``left_out``, by index in ``runs``); the ratios, in ``runs``' order."""
    ratios = {}
    for group in dict.fromkeys(run.source_group for run in runs):
        print(f"\n{group}")
        if markdown:
            print("| " + " | ".join(HEADER) + " |\n|" + "---|" * len(HEADER))
        else:
            widths = (-50, 7, 15, 16, 8, 8)
            print("".join(f"{cell:{'<' if w < 0 else '>'}{abs(w)}}" for cell, w in zip(HEADER, widths)), HEADER[6])
        for index in (i for i, run in enumerate(runs) if run.source_group == group):
            predicted = predict(runs[index])
            ratios[index] = ratio(runs[index], predicted)
            print(row(runs[index], predicted, (left_out or {}).get(index), markdown))
    return [ratios[index] for index in range(len(runs))]


def summary(runs: list[Run], columns: dict[str, list[float]], markdown: bool) -> None:
    """Median error and share within ±20 % of each column of ratios, for every run and by source group."""
    groups = list(dict.fromkeys(run.source_group for run in runs))
    names = [f"{c} {what}" for c in columns for what in ("median error", "within ±20 %")]
    print("\n| source group | runs | " + " | ".join(names) + " |\n|" + "---|" * (2 + len(names)))
    for group in [*groups, "all"]:
        inside = [group in ("all", run.source_group) for run in runs]
        cells = [group if group != "all" else f"**all {len(groups)} groups**", str(sum(inside))]
        for ratios in columns.values():
            errors = [abs(r - 1) for r, keep in zip(ratios, inside) if keep]
            cells += [f"{statistics.median(errors):.1%}", f"{sum(e <= 0.2 for e in errors)} of {len(errors)}"]
        print("| " + " | ".join(cells) + " |")


def memory(runs: list[Run]) -> None:
    """Whether each run plans as fitting its card (`PUBLISHED_HEADROOM`), which runs plan above what lit3d's default
    headroom leaves, and the planned peak beside the published one where published."""
    misses, tight, default = [], [], Training().headroom
    for run in runs:
        predicted = predict(run)
        peak = predicted.memory_per_gpu["total"] / 1e9
        card = run_gpu(run).memory_gb
        if not predicted.fits:
            misses.append(f"  - {run.name}: {peak:.1f} GB of the card's {card:.1f}")
        elif peak > card * (1 - default):
            why = MEMORY_GAPS.get(run.name, "not known why")
            tight.append(f"  - {run.name}: {peak:.1f} GB of the card's {card:.1f}, {peak / card * 100:.0f} % ({why})")
        if run.memory_gb is not None:
            print(f"memory: {run.name}: planned {peak:.1f} GB, published {run.memory_gb:.0f} GB "
                  f"(planned / published {peak / run.memory_gb:.2f})")  # fmt: skip
    fitting = len(runs) - len(misses)
    print(
        f"memory: {fitting} of {len(runs)} runs plan as fitting their card (its whole memory, as the run used it); "
        f"{fitting - len(tight)} of {len(runs)} with {default * 100:g} % of it kept free, lit3d's default"
        + ("; not fitting:" if misses else "")
    )
    if misses:
        print("\n".join(misses))
    if tight:
        print(f"memory: planned above {100 - default * 100:g} % of the card:\n" + "\n".join(tight))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument("--loso", action="store_true", help="also fit leave-one-source-out and print its errors")
    parser.add_argument("--fit", action="store_true", help="print the constants the fit chooses on every run")
    parser.add_argument("--sources", action="store_true", help="also print each run's source and assumptions")
    parser.add_argument(
        "--weighting",
        choices=list(WEIGHTINGS),
        default="group",
        help="each run's weight in the fits: 1/(its group's runs), 1, or 1/sqrt(its group's runs)",
    )
    args = parser.parse_args()
    columns, left_out = {}, None
    if args.loso or args.fit:
        grid = Grid(RUNS, weighting=args.weighting)
        constants, fitted = grid.fitted()
        print(f"fit on every run: {constants}")
        columns["fit on every run"] = list(fitted)
        if args.loso:
            ratios, folds = grid.left_out()
            for group, values in folds.items():
                print(f"fit without {group}: {values}")
            left_out = dict(enumerate(ratios))
            columns["leave-one-source-out"] = list(ratios)
    columns = {"shipped constants": report(RUNS, args.markdown, left_out), **columns}
    summary(RUNS, columns, args.markdown)
    memory(RUNS)
    if args.sources:  # each run's source and what was assumed where it is silent
        print()
        for run in RUNS:
            print(f"- {run.name}: {run.source}; assumed {run.assumed}")


if __name__ == "__main__":
    main()
