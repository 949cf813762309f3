"""Random combinations of the settings, each trained against one process: exact, refused before start, or failed.

    python benchmarks/combinations.py --count 40 --seed 1      # CPU ranks (gloo): 5 to 8 minutes on 2 cores
    python benchmarks/combinations.py --count 5 --seed 3 --markdown table.md
    python benchmarks/combinations.py --count 100 --dry-run    # only the draws and the checks, no rank started
    python benchmarks/combinations.py --muon-layouts --steps 8  # Muon in each layout of docs/muon.md, not drawn

Each draw combines every `lit3d.parallel.Parallelism` setting that changes what is computed (the sizes, at most
``--max-ranks`` ranks: data, tensor, pipeline, context and expert parallelism; the ZeRO stage and offload; sequence
parallelism; the pipeline schedule, its virtual stages, micro-batches and uneven stage layers; uneven data-parallel
shares; recompute; compile; the gradients' reduce dtype; FP8 and its all-gather; DiLoCo's ``sync_every`` within one
island; ``accumulate_unsharded`` where the strategy has it) with the loop's precision, gradient accumulation and
clipping, the model's Mixture of Experts, DeepSeek-V3's shape (latent attention and multi-token prediction, with
DeepSeekMoE when it has experts), gpt-oss's attention (windows in every other block, sinks, biases) and LoRA adapters,
the optimizer (AdamW, or Muon with its iteration in fp32) and the data's document masks.

A draw is first checked in this process as ``lit3d fit`` checks it before it starts any rank: the model, data and
Trainer are built (`Parallel3DStrategy`'s settings are refused there) and ``check_configuration`` runs. A refusal must
be one line naming the settings (a `ValueError`); anything else raised here is a failure. An accepted draw trains
``--steps`` optimizer steps on its ranks and validates once; so does one process (Lightning's own single-device
strategy, with the settings that change the algorithm itself: FP8, DiLoCo's outer step) on the same model, data and
loop. The draw is exact when every step's training loss and the validation loss are within ``1e-5`` relative of one
process's in fp32 (``1e-2`` under bf16-mixed, as the suite holds bf16 runs), and failed otherwise, or when a rank
raises or hangs (``--job-timeout``).

Draws run grouped by world size, each group in one spawn of CPU ranks (`benchmarks.rank_group`: spawning is the slow
part); a line is printed per draw as its outcome is known, and a markdown table at the end.

Not drawn: ``islands > 1`` (DiLoCo's islands train apart between outer steps by design: not one process's run; their
exactness is `tests/test_islands.py`'s), and the settings that change where or how a run is kept, not what it
computes (checkpointing, backend, timeout, start method).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.combination_draws import (  # noqa: E402
    BF16_TOLERANCE,
    GLOBAL_BATCH,
    MODEL,
    SEQ_LEN,
    Draw,
    draw,
    muon_layouts,
)
from benchmarks.rank_group import run_group  # noqa: E402

LEARNING_RATE = 3e-3  # (a loss that spikes would move bf16's rounding differences into the curve)
RUNNER = "benchmarks.combinations:train"


# ---------------------------------------------------------------- jobs: what a rank (or one process) trains


def job_of(d: Draw, corpus: Path, steps: int, model: dict = MODEL) -> dict:
    """The run of ``d`` as plain data (it travels to the ranks)."""
    config, lora = d.model(model)
    return {
        "model": config,
        "lora": lora if d.lora else None,
        "data": dict(
            data_path=str(corpus),
            seq_len=SEQ_LEN,
            global_batch_size=GLOBAL_BATCH,
            val_fraction=0.1,
            document_masking=d.documents,
        ),  # fmt: skip
        "trainer": dict(
            precision=d.precision,
            accumulate_grad_batches=d.accumulate,
            gradient_clip_val=d.clip,
            max_steps=steps,
            val_check_interval=steps * d.accumulate,
            limit_val_batches=1,
        ),  # fmt: skip
        "strategy": d.settings,
        "optimizer": "muon" if d.muon else "adamw",
    }


# The settings that change the algorithm itself rather than how it is split: one process runs them too.
ALGORITHM = ("float8", "sync_every")


def reference_of(job: dict) -> dict:
    """One process's run of ``job``: Lightning's single-device strategy, or `Parallel3DStrategy` on one rank with the
    settings of the algorithm itself (`ALGORITHM`)."""
    own = {k: v for k, v in job["strategy"].items() if k in ALGORITHM}
    return {**job, "strategy": own or None}


def build(job: dict, world: int) -> tuple[Any, Any, Any]:
    """The module, data and Trainer of ``job`` on ``world`` ranks (the strategy checks its settings here)."""
    from lit3d import GPT, GPTConfig, LoRA, Parallel3DStrategy
    from lit3d.data import TextDataModule

    muon = {"optimizer": "muon", "muon_ns_dtype": "float32"} if job.get("optimizer") == "muon" else {}
    model = GPT(GPTConfig(**job["model"]), learning_rate=LEARNING_RATE, warmup_steps=2,
                lora=LoRA(**job["lora"]) if job["lora"] else None, **muon)  # fmt: skip
    data = TextDataModule(**job["data"])
    strategy = Parallel3DStrategy(**job["strategy"]) if job["strategy"] is not None else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=world if job["strategy"] is not None else 1, strategy=strategy,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Losses()],
                        **job["trainer"])  # fmt: skip
    return model, data, trainer


def refusal(job: dict, world: int) -> tuple[str, str] | None:
    """What ``lit3d fit`` would refuse before starting a rank: ``("refused", the line)``, or ``("failed", ...)`` for
    anything that is not a refusal naming values; None if it starts."""
    from lit3d.strategies import Parallel3DStrategy

    try:
        model, data, trainer = build(job, world)
        strategy = trainer.strategy
        if isinstance(strategy, Parallel3DStrategy):
            strategy._lightning_module = model  # as `Trainer.fit` connects it before the launcher checks
            strategy.check_configuration(trainer, data)
    except ValueError as error:
        message = str(error)
        return ("refused", message) if "\n" not in message.strip() else ("failed", "a refusal of several lines")
    except Exception as error:  # anything else raised before a rank starts is a failure, not a refusal
        return "failed", f"before start: {type(error).__name__}: {error}"
    return None


def train(job: dict, job_dir: Path, world: int) -> dict:
    """On each rank (`benchmarks.rank_group`): train ``job``; the losses one process logs."""
    L.seed_everything(1234, verbose=False)
    model, data, trainer = build(job, world)
    trainer.fit(model, data)
    losses = next(c for c in trainer.callbacks if isinstance(c, Losses))
    return {"train_loss": losses.train, "val_loss": losses.val}


class Losses(L.Callback):
    """The training loss of each optimizer step and each validation's loss, as logged."""

    def __init__(self) -> None:
        self.train: list[float] = []
        self.val: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step > len(self.train) and "train_loss" in trainer.callback_metrics:
            self.train.append(float(trainer.callback_metrics["train_loss"]))

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:
            self.val.append(float(trainer.callback_metrics["val_loss"]))


# ---------------------------------------------------------------- the sweep


def compare(d: Draw, run: dict, reference: dict, steps: int) -> None:
    """Set ``d``'s outcome from its run against one process's."""
    if "error" in run:
        d.outcome, d.detail = "failed", run["error"]
        return
    if "error" in reference:
        d.outcome, d.detail = "failed", f"one process failed: {reference['error']}"
        return
    ours, theirs = run["ranks"][0], reference["ranks"][0]
    if len(ours["train_loss"]) != steps or len(theirs["train_loss"]) != steps or not ours["val_loss"]:
        d.outcome, d.detail = "failed", f"logged {len(ours['train_loss'])} of {steps} steps"
        return
    pairs = list(zip(ours["train_loss"] + ours["val_loss"][-1:], theirs["train_loss"] + theirs["val_loss"][-1:]))
    worst = max(abs(a - b) / abs(b) for a, b in pairs)
    d.extra["worst"] = worst
    within = worst <= d.tolerance
    d.outcome = "exact" if within else "failed"
    d.detail = f"max relative difference {worst:.1e} {'<=' if within else '>'} {d.tolerance:g}"


def sweep(
    draws: list[Draw], out: Path, steps: int, job_timeout: float, print_line: Any = print, dry_run: bool = False
) -> None:
    corpus = write_corpus(out / "corpus.jsonl")
    jobs = {d.index: job_of(d, corpus, steps) for d in draws}
    started = time.time()
    for d in draws:
        refused = refusal(jobs[d.index], d.world)
        if refused is not None:
            d.outcome, d.detail = refused
            print_line(line(d, len(draws)))
        elif dry_run:
            print_line(line(d, len(draws)))
    runs = [d for d in draws if not d.outcome]
    if dry_run:
        return
    one_process: dict[str, dict] = {}  # one process's runs, by name: draws of the same model, data and loop share one
    reference: dict[int, str] = {}
    for d in runs:
        job = reference_of(jobs[d.index])
        reference[d.index] = next((n for n, j in one_process.items() if j == job), f"one_process{len(one_process) + 1}")
        one_process[reference[d.index]] = job
    print_line(f"one process: {len(one_process)} runs of {steps} steps ...")
    done = run_group(1, one_process, RUNNER, out / "one_process", job_timeout)
    print_line(f"one process: done in {time.time() - started:.0f} s")
    for world in sorted({d.world for d in runs}):
        group = {str(d.index): d for d in runs if d.world == world}
        clock = Clock()

        def report(name: str, result: dict, group: dict = group, clock: Clock = clock) -> None:
            d = group[name]
            d.seconds = clock.lap()
            compare(d, result, done[reference[d.index]], steps)
            print_line(line(d, len(draws)))

        run_group(world, {n: jobs[d.index] for n, d in group.items()}, RUNNER, out / f"world{world}", job_timeout,
                  on_result=report)  # fmt: skip


class Clock:
    """Seconds since the last lap."""

    def __init__(self) -> None:
        self.last = time.time()

    def lap(self) -> float:
        now, last = time.time(), self.last
        self.last = now
        return now - last


def write_corpus(path: Path) -> Path:
    """Short documents of a few words (the same for every seed): packed several to a row, so masks matter."""
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "def", "(", ")", ":"]
    lines = [json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(2, 40)))}) for _ in range(600)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def line(d: Draw, count: int) -> str:
    if not d.outcome:
        return f"draw {d.index}/{count} [{d.world} ranks] {d.layout()} | {d.loop()} | {d.model_and_data()}: accepted"
    seconds = f", {d.seconds:.0f} s" if d.seconds else ""
    return (f"draw {d.index}/{count} [{d.world} ranks] {d.layout()} | {d.loop()} | {d.model_and_data()}: "
            f"{d.outcome} ({d.detail}{seconds})")  # fmt: skip


def table(draws: list[Draw]) -> str:
    rows = ["| # | ranks | layout | loop | model, data | outcome | detail |", "|---|---|---|---|---|---|---|"]
    for d in draws:
        detail = d.detail.replace("|", "\\|")
        rows.append(f"| {d.index} | {d.world} | {d.layout()} | {d.loop()} | {d.model_and_data()} | {d.outcome} | "
                    f"{detail} |")  # fmt: skip
    return "\n".join(rows)


def summary(draws: list[Draw]) -> str:
    count = {outcome: sum(d.outcome == outcome for d in draws) for outcome in ("exact", "refused", "failed")}
    fp32 = sum(d.outcome == "exact" and d.precision == "32-true" for d in draws)
    worst = max((d.extra["worst"] for d in draws if "worst" in d.extra and d.precision == "32-true"), default=0.0)
    return (f"{count['exact'] + count['refused']} of {len(draws)} exact or refused before start: {count['exact']} "
            f"exact ({fp32} in fp32, worst {worst:.1e}; {count['exact'] - fp32} under bf16-mixed within "
            f"{BF16_TOLERANCE:g}), {count['refused']} refused, {count['failed']} failed")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=10, help="how many combinations to draw")
    parser.add_argument("--seed", type=int, default=0, help="the draws' seed (the same seed draws the same)")
    parser.add_argument("--max-ranks", type=int, default=8, help="the most ranks a draw may use")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps each run trains")
    parser.add_argument("--job-timeout", type=float, default=600, help="seconds a run may take before it counts hung")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    parser.add_argument("--out", type=Path, help="where the runs write (default: a temporary folder)")
    parser.add_argument("--dry-run", action="store_true", help="only draw and check: start no rank")
    parser.add_argument("--muon-layouts", action="store_true", help="instead of drawing: Muon in each of its layouts")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    draws = muon_layouts() if args.muon_layouts else [draw(rng, i + 1, args.max_ranks) for i in range(args.count)]
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        sweep(draws, args.out or Path(tmp), args.steps, args.job_timeout, lambda text: print(text, flush=True),
              args.dry_run)  # fmt: skip
    if args.dry_run:
        return 0
    print()
    print(table(draws))
    print()
    print(summary(draws))
    if args.markdown:
        args.markdown.write_text(table(draws) + "\n\n" + summary(draws) + "\n")
    return 0 if all(d.outcome in ("exact", "refused") for d in draws) else 1


if __name__ == "__main__":
    sys.exit(main())
