"""The planner's clock against published training runs: tokens/s per GPU and MFU, predicted beside measured.

    python benchmarks/planner_vs_published.py            # the calibration runs and the held-out ones
    python benchmarks/planner_vs_published.py --markdown # the table of benchmarks/README.md

Each run (`benchmarks/published_runs.py`) is planned as published: its model, GPUs (and power cap), sequence length,
batches, layout, recompute, compile and kernels (`lit3d.planner.inputs.Software`), with `lit3d.planner.plan` on the
fixed layout. The ratio is predicted / published, in the unit the source publishes (tokens/s per GPU, or MFU against
989 TFLOP/s with the source's FLOP count, which for these models is the planner's: 6 per matmul weight plus
attention's 12 · layers · width · sequence, causal not halved). The calibration runs are the ones the fitted
constants of `lit3d.planner.calibration` were chosen on; the held-out runs were not used to choose them. Arithmetic
only: a second or two on a CPU.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.published_runs import (
    CALIBRATION,
    HELD_OUT,
    MEGATRON,
    Run,
)
from lit3d.planner import Cluster, Plan, Request, plan
from lit3d.planner.calibration import ASYNC_TP, HOPPER, MEGATRON_TP_OVERLAP
from lit3d.planner.hardware import GPUS

# The number of kinds the breakdown has, printed largest first.
KINDS = ("compute", "memory_bound", "communication", "bubble", "optimizer", "overhead")


def predict(run: Run, constants: dict[str, float] | None = None) -> Plan:
    """The planner's plan of ``run`` as published (with the fitted ``constants`` replaced, `FITTED`)."""
    settings = dict(run.cluster)
    cluster = Cluster.of(settings.pop("gpu", GPUS["H100"]), run.gpus // 8, 8, **settings)
    loop = dict(run.loop)
    if constants:
        efficiency = replace(cluster.gpu.efficiency, **{k: v for k, v in constants.items() if k in EFFICIENCY})
        cluster = replace(cluster, gpu=replace(cluster.gpu, efficiency=efficiency))
        software = loop["software"]
        if software.tp_overlap:
            overlap = constants["MEGATRON_TP_OVERLAP" if run.source == MEGATRON else "ASYNC_TP"]
            loop["software"] = replace(software, tp_overlap=overlap)
    given = {**run.layout, **loop}
    return plan(Request.given(run.model, cluster, precision="bf16-mixed", **given)).chosen.plan


# The constants fitted to the calibration runs, and the values `--fit` tries for each.
EFFICIENCY = {
    "gemm": [x / 200 for x in range(110, 181)],
    "gemm_half_dim": [float(x) for x in range(0, 801, 25)],
    "overlap_cost": [x / 40 for x in range(0, 21)],
    "step_overhead_ms": [float(x) for x in range(0, 101, 5)],
}
FITTED = {**EFFICIENCY, "ASYNC_TP": [x / 20 for x in range(21)], "MEGATRON_TP_OVERLAP": [x / 20 for x in range(21)]}


def fit(runs: list[Run]) -> dict[str, float]:
    """Coordinate descent over `FITTED` from the current constants: the values that minimise the worst error over
    ``runs`` (log ratio), then their mean squared log ratio and that of async TP's speedup over vanilla TP (a run
    named ``X, async TP`` against the run ``X``)."""
    current = {name: getattr(HOPPER, name) for name in EFFICIENCY} | {
        "ASYNC_TP": ASYNC_TP, "MEGATRON_TP_OVERLAP": MEGATRON_TP_OVERLAP}  # fmt: skip

    def loss(constants: dict[str, float]) -> float:
        logs = {run.name: math.log(ratio(run, predict(run, constants))) for run in runs}
        speedups = [logs[name] - logs[name.removesuffix(", async TP")] for name in logs if name.endswith("async TP")]
        squares = [x * x for x in [*logs.values(), *speedups]]
        return max(abs(x) for x in logs.values()) + sum(squares) / len(squares)

    best = loss(current)
    for sweep in range(3):
        for name, values in FITTED.items():
            for value in values:
                trial = {**current, name: value}
                trial_loss = loss(trial)
                if trial_loss < best:
                    current, best = trial, trial_loss
        print(f"sweep {sweep + 1}: {current}, loss {best:.5f}", flush=True)
    return current


def ratio(run: Run, predicted: Plan) -> float:
    value = predicted.tokens_per_s_per_gpu if run.unit == "tokens" else predicted.mfu
    return value / run.measured


def shares(predicted: Plan) -> dict[str, float]:
    """The step's seconds by kind, as shares of it (communication: all axes' exposed time)."""
    breakdown = predicted.time_breakdown
    seconds = {kind: breakdown.get(kind, 0.0) for kind in KINDS}
    seconds["communication"] = sum(breakdown["exposed_communication"].values())
    return {kind: value / predicted.step_time_s for kind, value in seconds.items()}


def row(run: Run, predicted: Plan, markdown: bool) -> str:
    measured = f"{run.measured:,.0f} tok/s" if run.unit == "tokens" else f"{run.measured:.0%} MFU"
    mine = f"{predicted.tokens_per_s_per_gpu:,.0f} tok/s" if run.unit == "tokens" else f"{predicted.mfu:.1%} MFU"
    split = shares(predicted)
    largest = ", ".join(f"{kind} {split[kind]:.0%}" for kind in sorted(split, key=split.get, reverse=True)[:3])
    cells = (run.name, f"{run.gpus:,}", measured, mine, f"{ratio(run, predicted):.3f}",
             f"{predicted.mfu:.1%}", largest)  # fmt: skip
    if markdown:
        return "| " + " | ".join(cells) + " |"
    return f"{cells[0]:<40}{cells[1]:>6}{cells[2]:>16}{cells[3]:>18}{cells[4]:>8}{cells[5]:>8}  {cells[6]}"


def report(title: str, runs: list[Run], markdown: bool, constants: dict[str, float] | None = None) -> list[float]:
    header = ("run", "GPUs", "published", "planner", "ratio", "MFU", "step time, largest shares")
    print(f"\n{title}")
    if markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    else:
        print(f"{header[0]:<40}{header[1]:>6}{header[2]:>16}{header[3]:>18}{header[4]:>8}{header[5]:>8}  {header[6]}")
    ratios = []
    for run in runs:
        predicted = predict(run, constants)
        ratios.append(ratio(run, predicted))
        print(row(run, predicted, markdown))
    errors = [abs(r - 1) for r in ratios]
    print(f"median error {statistics.median(errors):.1%}, worst {max(errors):.1%}, within ±15 %: "
          f"{sum(e <= 0.15 for e in errors)} of {len(errors)}")  # fmt: skip
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument("--sources", action="store_true", help="also print each run's source and assumptions")
    parser.add_argument(
        "--fit",
        action="store_true",
        help="fit the constants of `FITTED` to the calibration runs (Hopper's GEMM efficiency and shape, overlap cost, "
        "step overhead, the TP overlaps) and report with them",
    )
    args = parser.parse_args()
    constants = fit(CALIBRATION) if args.fit else None
    report("calibration runs (the fitted constants were chosen on these)", CALIBRATION, args.markdown, constants)
    report("held-out runs (not used to choose them)", HELD_OUT, args.markdown, constants)
    if args.sources:  # each source's runs and what was assumed where it is silent (8 GPUs per node throughout)
        print()
        for source in dict.fromkeys(run.source.split(",")[0] for run in CALIBRATION + HELD_OUT):
            runs = [run for run in CALIBRATION + HELD_OUT if run.source.startswith(source)]
            assumed = "; ".join(dict.fromkeys(run.assumed for run in runs))
            print(f"- {source} ({len(runs)} runs): assumed {assumed}")


if __name__ == "__main__":
    main()
