"""FP8 against bf16 on the CPU demo: the `tiny` GPT of ``configs/tiny.yaml`` trained for 200 steps in bf16-mixed, then
with FP8 linears (``tensorwise``, ``rowwise``), from the same seed and batches; the loss curves in one picture.

    python benchmarks/float8_curves.py                          # ~10 minutes on 2 cores
    python benchmarks/float8_curves.py --steps 50 --plot none   # a quick look

Each run is the command a user types (``lit3d fit --config configs/tiny.yaml --trainer.precision=bf16-mixed
--trainer.strategy=Parallel3DStrategy --trainer.strategy.float8=rowwise``), on one process. Printed: each run's final
loss (the mean of its last 10 logged steps, which smooths one batch's noise) and its difference from bf16's, and the
seconds each took (on a CPU, FP8 matmuls are torchao's emulation in fp32: not a speed measurement;
`benchmarks/strategies.py --float8` times them on a GPU, `benchmarks/fp8_cpu.py` the CPU path).
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"bf16-mixed": None, "fp8 tensorwise": "tensorwise", "fp8 rowwise": "rowwise"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--plot", default=str(ROOT / "docs" / "fp8_loss.png"), help="picture, or 'none'")
    args = parser.parse_args()
    curves, seconds = {}, {}
    with tempfile.TemporaryDirectory() as out:
        for name, recipe in RUNS.items():
            start = time.perf_counter()
            curves[name] = run(recipe, args.steps, Path(out) / name.replace(" ", "_"))
            seconds[name] = time.perf_counter() - start
            print(f"{name}: {len(curves[name])} losses logged in {seconds[name]:.0f} s", flush=True)
    base = final(curves["bf16-mixed"])
    print(f"\nfinal loss (mean of the last 10 logged steps) after {args.steps} steps, against bf16-mixed:")
    for name, curve in curves.items():
        print(f"  {name:15s} {final(curve):.4f}  {100 * (final(curve) - base) / base:+.2f} %")
    if args.plot != "none":
        plot(curves, Path(args.plot))
        print(f"wrote {args.plot}")


def run(recipe: str | None, steps: int, folder: Path) -> list[tuple[int, float]]:
    """One ``lit3d fit`` of the demo; its (step, train_loss) pairs."""
    command = [sys.executable, "-m", "lit3d.cli", "fit", "--config", str(ROOT / "configs" / "tiny.yaml"),
               f"--trainer.max_steps={steps}", "--trainer.precision=bf16-mixed", "--trainer.log_every_n_steps=1",
               f"--trainer.val_check_interval={steps}", "--trainer.strategy=Parallel3DStrategy",
               f"--trainer.logger.init_args.save_dir={folder}", "--trainer.logger.init_args.name=run",
               "--trainer.enable_checkpointing=false"]  # fmt: skip
    if recipe:
        command.append(f"--trainer.strategy.float8={recipe}")
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    rows = csv.DictReader((folder / "run" / "version_0" / "metrics.csv").open())
    return [(int(r["step"]), float(r["train_loss"])) for r in rows if r.get("train_loss")]


def final(curve: list[tuple[int, float]]) -> float:
    last = [loss for _, loss in curve[-10:]]
    return sum(last) / len(last)


def plot(curves: dict[str, list[tuple[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        axis.plot([s for s, _ in curve], [loss for _, loss in curve], label=name, linewidth=1.2)
    axis.set(xlabel="step", ylabel="training loss", title="tiny GPT on CPU: bf16-mixed against FP8 linears")
    axis.set_yscale("log")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
