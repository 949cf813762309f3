"""The measurements of `benchmarks/gpu_check.py`, by section: ``python benchmarks/gpu_runs.py SECTION[,SECTION] WORK``.

Each section reads ``WORK/settings.json`` (the shapes, steps and deadline `gpu_check.py` chose) and writes
``WORK/SECTION.json`` after every item, so an item that hangs or kills the process loses only itself and what came
after. Every item runs in its own try/except: its error is recorded and the section goes on; an item the deadline
leaves no time for is skipped. The runs themselves are `benchmarks/gpu_training.py`'s.

- ``peers``: `Parallel3DStrategy` 1x1x1 against Lightning's ``auto`` with the same `lit3d.GPT`, and against
  transformers' ``LlamaForCausalLM`` of the same shape in a plain PyTorch loop (same batches, same fused AdamW, SDPA),
  with ``torch.compile`` off and on (each block compiled alike: `apply_compile`).
- ``extras``: LoRA, ZeRO-3 with ``offload=True`` on one rank, a synchronous and an asynchronous checkpoint save (how
  long training blocks), a resume from the checkpoint, ``lit3d generate`` tokens/s, and windowed attention against
  SDPA with a full mask (`benchmarks/gpu_attention.py`).
- ``fp8``: ``float8="tensorwise"`` and ``"rowwise"`` against bf16, on a wide model and on the peers' model.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

STARTED = time.time()
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402

from benchmarks.gpu_attention import window_attention_run  # noqa: E402
from benchmarks.gpu_training import (  # noqa: E402
    checkpoint_run,
    free_memory,
    generate_run,
    largest_micro_batch,
    lightning_run,
    resume_run,
    transformers_run,
    with_smaller_batch,
)
from lit3d import GPTConfig, LoRA  # noqa: E402
from lit3d.planner.hardware import identify, unknown_device  # noqa: E402

READY = time.time()  # (imports took READY - STARTED: a dry run's largest cost on a small machine)


class Section:
    """One section's results, written to ``WORK/NAME.json`` after every item; items past the deadline are skipped."""

    def __init__(self, name: str, work: Path, settings: dict[str, Any]) -> None:
        self.path, self.settings = work / f"{name}.json", settings
        self.results: dict[str, Any] = {
            "environment": environment(),
            "imports_s": round(READY - STARTED, 1),
            "items": {},
        }
        self.write()

    def write(self) -> None:
        partial = self.path.with_suffix(".partial")  # NOTE: then renamed: a process ended mid-write leaves the last
        partial.write_text(json.dumps(self.results, indent=2, default=str))
        partial.replace(self.path)

    def skip(self, item: str, reason: str) -> None:
        self.results["items"][item] = {"skipped": reason}
        self.write()

    def run(self, item: str, estimate_s: float, measure: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """``measure()``'s record under ``item``, or its error; skipped if the deadline leaves under ``estimate_s``."""
        left = self.settings["deadline"] - time.time()
        if left < estimate_s:
            self.skip(item, f"{left:.0f} s left of the time budget, ~{estimate_s:.0f} needed")
            return None
        print(f"[{item}] ...", flush=True)
        began = time.time()
        try:
            record = measure()
        except Exception as error:  # recorded, and the section goes on
            traceback.print_exc()
            record = {"error": f"{type(error).__name__}: {error}"[:2000]}
        try:
            free_memory()
        except Exception as error:  # (a CUDA error leaves the device unusable: the items after it say so)
            record.setdefault("note", f"freeing memory afterwards failed: {error}"[:500])
        record["wall_s"] = round(time.time() - began, 1)
        self.results["items"][item] = record
        self.write()
        print(f"[{item}] {json.dumps(record, default=str)[:400]}", flush=True)
        return record


def environment() -> dict[str, Any]:
    """The device and the versions that ran the section."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    found = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "lightning": L.__version__,
        "transformers": installed("transformers"),
        "torchao": installed("torchao"),
    }
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        gpu = identify(name)
        properties = torch.cuda.get_device_properties(0)
        found.update(
            device=name,
            hardware=gpu.name if gpu else None,
            memory_bytes=properties.total_memory,
            capability=list(torch.cuda.get_device_capability()),
            unknown=None if gpu else unknown_device(name),
        )
    else:
        found.update(device=f"CPU ({os.cpu_count()} cores)", hardware="CPU", memory_bytes=None, capability=None)
    return found


def peers(section: Section) -> None:
    settings = section.settings
    config = GPTConfig(**settings["model"])
    micro = settings.get("micro_batch_found") or largest_micro_batch(config, settings)
    section.results["micro_batch"] = micro
    for compile in (False, settings["compile"]):
        on = "compile" if compile else "eager"
        estimate = settings["estimate_s"]["compiled" if compile else "eager"]
        systems = {
            "3d": partial(lightning_run, config, settings=settings, system="3d", compile=compile),
            "auto": partial(lightning_run, config, settings=settings, system="auto", compile=compile),
            "transformers": partial(transformers_run, config, settings=settings, compile=compile),
        }
        for system, train in systems.items():
            result = section.run(f"{system} {on}", estimate, partial(with_smaller_batch, train, micro))
            if system == "3d" and result and result.get("micro_batch"):  # the others at the micro-batch lit3d ran
                micro = section.results["micro_batch"] = result["micro_batch"]


def fp8(section: Section) -> None:
    """FP8 against bf16, compiled as FP8 training runs: a wide model first (where FP8 pays), then the peers' one."""
    settings = section.settings
    if settings["accelerator"] == "gpu" and tuple(torch.cuda.get_device_capability()) < (8, 9):
        section.results["skipped"] = (
            f"{torch.cuda.get_device_name()} has no FP8 tensor cores (compute capability < 8.9)"
        )
        section.write()
        return
    estimate, compile = settings["estimate_s"]["compiled"], settings["compile"]
    for shape in ("wide", "model"):
        config = GPTConfig(**settings["model" if shape == "model" else "fp8_model"])
        found = settings.get("micro_batch_found") if shape == "model" else None
        micro = found or min(largest_micro_batch(config, settings, compile=True), settings["fp8_micro_batch_cap"])
        for recipe in ([None] if shape == "wide" else []) + ["tensorwise", "rowwise"]:
            item = f"{shape} {recipe or 'bf16'}"
            train = partial(lightning_run, config, settings=settings, system="3d", compile=compile, float8=recipe)
            section.run(item, estimate, partial(with_smaller_batch, train, micro))


def extras(section: Section) -> None:
    settings = section.settings
    config, side = GPTConfig(**settings["model"]), GPTConfig(**settings["side_model"])
    estimate, side_micro, work = settings["estimate_s"]["eager"], settings["side_micro_batch"], Path.cwd()
    lora = LoRA(rank=16, targets=("q", "k", "v", "o", "gate", "up", "down"))
    micro = settings.get("micro_batch_found") or largest_micro_batch(config, settings, lora=lora)
    train = partial(lightning_run, config, settings=settings, system="3d", compile=False, lora=lora)
    section.run("lora", estimate, partial(with_smaller_batch, train, micro))
    offloaded = partial(lightning_run, side, side_micro, settings, "3d", False, zero_stage=3, offload=True)
    section.run("zero3 offload", estimate, offloaded)
    saves = {}
    for name, asynchronous in (("sync", False), ("async", True)):
        path = work / f"{name}.ckpt"
        saved = section.run(
            f"checkpoint {name}", estimate, partial(checkpoint_run, side, side_micro, settings, path, asynchronous)
        )
        if saved and "losses" in saved:
            saves[name] = (path, saved)
    if "async" in saves:
        section.run("resume", estimate, partial(resume_run, side, side_micro, settings, *saves["async"]))
    else:
        section.skip("resume", "no asynchronous checkpoint to resume from")
    if saves:
        path = saves.get("async", saves.get("sync"))[0]
        section.run("generate", estimate, partial(generate_run, path, settings))
    else:
        section.skip("generate", "no checkpoint to generate from")
    section.run("window attention", settings["estimate_s"]["section"], partial(window_attention_run, settings))


SECTIONS = {"peers": peers, "extras": extras, "fp8": fp8}


def main() -> None:
    names, work = sys.argv[1].split(","), Path(sys.argv[2])
    settings = json.loads((work / "settings.json").read_text())
    os.chdir(work)  # NOTE: whatever Lightning, compile or DCP write lands in the work folder
    for name in names:
        section = Section(name, work, settings)
        SECTIONS[name](section)
        section.results["done"] = True
        section.write()
        if section.results.get("micro_batch"):  # the peers' micro-batch, for the sections after them
            settings["micro_batch_found"] = section.results["micro_batch"]


if __name__ == "__main__":
    main()
