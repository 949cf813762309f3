"""lit3d on one GPU in one command: against its peers on the same card, against its own planner, FP8, and what else
must work on CUDA; at most 8 minutes of wall-clock, compile included, with no network.

    python benchmarks/gpu_check.py --output DIR             # on one GPU (an H100 or H200: the targets are theirs)
    python benchmarks/gpu_check.py --output DIR --dry-run   # the same code path on CPU, tiny shapes, under a minute

Writes ``DIR/gpu_check.json`` (every figure), ``DIR/gpu_check.md`` (the table: device, PyTorch/CUDA versions, commit,
each figure, each target and whether it is met) and ``DIR/gpu_check.log`` (what the sections printed); writes nothing
else but a temporary folder, which it removes. Exits 1 if any item failed (its error is in the table).

Every figure is measured in the same run, after a warm-up, as the median of the measured steps. The sections, in this
order (on a GPU each in a process of its own, `benchmarks/gpu_runs.py`, ended when the time budget runs out):

1. ``peers``: the ``llama3.2-1b`` preset, bf16-mixed, seq 2048, the largest micro-batch the planner says fits, fused
   AdamW, ``torch.compile`` off and on: `Parallel3DStrategy` 1x1x1 against Lightning's ``auto`` with the same
   `lit3d.GPT`, and against transformers' ``LlamaForCausalLM`` of the same shape in a plain PyTorch loop.
2. ``extras``: LoRA on the 1B, ZeRO-3 with ``offload=True`` on one rank, a synchronous and an asynchronous checkpoint
   save (how long training blocks), a resume from the checkpoint, ``lit3d generate`` tokens/s.
3. ``fp8``: ``float8="tensorwise"`` and ``"rowwise"`` against bf16 on llama-70b's blocks (d_model 8192, 2 blocks: where
   FP8 pays), then on the 1B; on cards with FP8 tensor cores.
4. ``planner``: ``lit3d plan --json`` for exactly the lit3d runs of ``peers`` (the card named as PyTorch names it),
   its step time and peak memory beside the measured ones (torch-free, in this process: a second).

Between sections and between runs the time left is checked: what would not finish is skipped, with a note. Hugging
Face runs offline (``HF_HUB_OFFLINE=1``: the transformers model is built from a ``LlamaConfig``, nothing downloaded).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_table import markdown, targets  # noqa: E402
from lit3d.models.config import PRESETS, GPTConfig  # noqa: E402  (torch-free, as is the planner this process runs)

SECTIONS = ("peers", "extras", "fp8", "planner")
# The shapes and step counts of a GPU run and of the dry run (the same code path on CPU, in seconds).
GPU_RUN = {
    "accelerator": "gpu",
    "model": GPTConfig.from_name("llama3.2-1b").to_dict(),
    "fp8_model": GPTConfig(
        name="llama-70b blocks",
        n_layer=2,
        n_head=64,
        n_kv_head=8,
        d_model=8192,
        d_ff=28672,
        vocab_size=32768,
        max_seq_len=2048,
        rope_theta=500000.0,
    ).to_dict(),
    "side_model": GPTConfig.from_name("llama3.2-1b", n_layer=4, vocab_size=32768).to_dict(),
    "side_micro_batch": 4,
    "fp8_micro_batch_cap": 8,  # (16k tokens a step: GEMMs large enough for FP8 to pay, and 3 compiled runs in time)
    "seq_len": 2048,
    "warmup": 3,
    "steps": 6,
    "compile": True,
    "save_step": 3,
    "generate_tokens": 256,
    "resume_tolerance": 2e-2,
    "estimate_s": {"eager": 25, "compiled": 75, "section": 15},
    "isolate": True,
}
DRY_RUN = {
    "accelerator": "cpu",
    "model": GPTConfig(
        name="tiny", n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=192, max_seq_len=64, tie_embeddings=True
    ).to_dict(),
    "fp8_model": GPTConfig(
        name="tiny-wide", n_layer=2, n_head=4, n_kv_head=2, d_model=128, d_ff=384, max_seq_len=64
    ).to_dict(),
    "side_model": GPTConfig(
        name="tiny", n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=192, max_seq_len=64, tie_embeddings=True
    ).to_dict(),
    "micro_batch": 2,
    "side_micro_batch": 2,
    "fp8_micro_batch_cap": 2,
    "seq_len": 32,
    "warmup": 1,
    "steps": 2,
    "compile": "eager",  # NOTE: Dynamo traces every compiled block as on a GPU; Inductor's code generation is skipped
    "save_step": 2,
    "generate_tokens": 16,
    "resume_tolerance": 1e-4,
    "estimate_s": {"eager": 1, "compiled": 2, "section": 2},
    "isolate": False,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="folder for gpu_check.json, gpu_check.md and gpu_check.log")
    parser.add_argument("--dry-run", action="store_true", help="the same code path on CPU with tiny shapes")
    parser.add_argument("--budget-s", type=float, default=None, help="wall-clock budget (default 480; dry run 300)")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS, help="run only these")
    args = parser.parse_args(argv)
    began = time.time()
    budget = args.budget_s if args.budget_s is not None else 300.0 if args.dry_run else 480.0
    output = Path(args.output).resolve()
    output.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lit3d-gpu-check-"))
    settings = {**(DRY_RUN if args.dry_run else GPU_RUN), "deadline": began + budget - 5}  # (5 s to write up)
    results: dict[str, Any] = {
        "dry_run": args.dry_run,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": commit(),
        "budget_s": budget,
        "settings": settings,
        "sections": {},
    }
    log = output / "gpu_check.log"
    log.write_text("")
    # The sections that train, each in a process of its own on a GPU (a CUDA error, a hang or a crash ends only it);
    # in one process in a dry run, which would spend most of its minute importing torch again.
    trained = [name for name in args.sections if name != "planner"]
    groups = [[name] for name in trained] if settings["isolate"] else [trained] if trained else []
    try:
        for group in groups:
            print(f"== {', '.join(group)}", flush=True)
            results["sections"].update(sections(group, settings, work, log, budget))
            if results["sections"].get("peers", {}).get("micro_batch"):  # what the sections after it train with
                settings["micro_batch_found"] = results["sections"]["peers"]["micro_batch"]
        if "planner" in args.sections:  # (torch-free and quick: after the budget's end too)
            print("== planner", flush=True)
            results["sections"]["planner"] = planner(results["sections"], settings, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["environment"] = next((s["environment"] for s in results["sections"].values() if "environment" in s), {})
    results["wall_s"] = round(time.time() - began, 1)
    results["targets"] = targets(results)
    (output / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    table = markdown(results)
    (output / "gpu_check.md").write_text(table)
    print(table)
    return 1 if failures(results) else 0


def sections(names: list[str], settings: dict[str, Any], work: Path, log: Path, budget: float) -> dict[str, Any]:
    """Run the sections ``names`` in one process (`gpu_runs.py`), ended at the deadline; what each wrote."""
    left = settings["deadline"] - time.time()
    if left < settings["estimate_s"]["section"]:
        return {name: {"skipped": f"{left:.0f} s left of the {budget:.0f} s budget"} for name in names}
    (work / "settings.json").write_text(json.dumps(settings))
    for folder in ("hf", "cache", "tmp"):
        (work / folder).mkdir(exist_ok=True)
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "PYTHONUNBUFFERED": "1",
        # No network, and no writes outside the work folder: Hugging Face offline, every cache in the work folder.
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(work / "hf"),
        "XDG_CACHE_HOME": str(work / "cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
        "TRITON_CACHE_DIR": str(work / "triton"),
        "CUDA_CACHE_PATH": str(work / "cuda"),
        "TMPDIR": str(work / "tmp"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_runs.py"), ",".join(names), str(work)]
    with log.open("a") as out:
        out.write(f"\n===== {', '.join(names)} =====\n")
        out.flush()
        # NOTE: a session of its own, so that the end of the budget ends it with its children (compile workers).
        process = subprocess.Popen(
            command, cwd=work, env=environment, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code, ended = process.wait(timeout=max(1.0, left)), None
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            code, ended = process.wait(), f"ended at the end of the time budget, after {left:.0f} s"
    results = {}
    for name in names:
        written = work / f"{name}.json"
        result = json.loads(written.read_text()) if written.exists() else None
        if result is None and ended:
            result = {"skipped": f"not reached: {ended}"}
        elif result is None:
            result = {"error": f"its process exited with {code} before the section began (see gpu_check.log)"}
        elif not result.get("done"):
            result["error"] = ended or f"its process exited with {code} (see gpu_check.log)"
        results[name] = result
    return results


def planner(sections: dict[str, Any], settings: dict[str, Any], work: Path) -> dict[str, Any]:
    """``lit3d plan --json`` for exactly each measured lit3d run, the card named by its ``get_device_name()``."""
    from lit3d.cli.plan_command import command_line
    from lit3d.planner.hardware import identify, unknown_device

    peers = sections.get("peers", {})
    device = peers.get("environment", {}).get("device")
    if device is None or "micro_batch" not in peers:
        return {"skipped": "the peers section measured nothing to plan"}
    gpu = device if settings["accelerator"] == "gpu" else "CPU"
    if settings["accelerator"] == "gpu" and identify(device) is None:
        return {"error": unknown_device(device)}
    model = GPTConfig(**settings["model"])
    preset = model.name in PRESETS and GPTConfig.from_name(model.name) == model
    spec = model.name if preset else model_file(model, work)  # a shape that is no preset: a YAML of its fields
    plans: dict[str, Any] = {"gpu": gpu, "items": {}}
    for item, compile in (("3d eager", False), ("3d compile", bool(settings["compile"]))):
        measured = peers["items"].get(item, {})
        micro = measured.get("micro_batch", peers["micro_batch"])
        flags = dict(
            model=spec,
            gpu=gpu,
            nodes=1,
            gpus_per_node=1,
            seq_len=settings["seq_len"],
            micro_batch_size=micro,
            global_batch_size=micro,
            precision="bf16-mixed",
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            zero_stage=0,
            compile=str(compile).lower(),
            json="true",
        )
        arguments = [part for name, value in flags.items() for part in (f"--{name}", str(value))]
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                command_line(arguments)
            plan = json.loads(printed.getvalue())
            plans["items"][item] = {
                "command": shlex.join(["lit3d", "plan", *arguments]),
                "step_s": plan["step_time_s"],
                "peak_gb": plan["memory_per_gpu"]["total"] / 1e9,
            }
        except (Exception, SystemExit) as error:  # recorded, and the check goes on
            plans["items"][item] = {"error": f"{type(error).__name__}: {error}"}
    return plans


def model_file(model: GPTConfig, work: Path) -> str:
    import yaml

    path = work / "model.yaml"
    fields = {k: v for k, v in model.to_dict().items() if v is not None}
    path.write_text(yaml.safe_dump(fields))
    return str(path)


def commit() -> str:
    """The checkout's commit (``+changes`` when its files differ from it), or why there is none."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return head + (" +changes" if changed else "")
    except (OSError, subprocess.SubprocessError) as error:
        return f"unknown ({type(error).__name__})"


def failures(results: dict[str, Any]) -> list[str]:
    """Every item and section that failed, by name."""
    failed = []
    for name, result in results["sections"].items():
        if "error" in result:
            failed.append(name)
        failed += [f"{name}/{item}" for item, value in result.get("items", {}).items() if "error" in value]
    return failed


if __name__ == "__main__":
    sys.exit(main())
