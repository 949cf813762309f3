"""The measurements of `benchmarks/gpu_check.py`, a section per process: ``python benchmarks/gpu_runs.py SECTION WORK``.

Each section reads ``WORK/settings.json`` (the shapes, steps and deadline `gpu_check.py` chose) and writes
``WORK/SECTION.json`` after every item, so an item that hangs or kills the process loses only itself and what came
after. Every item runs in its own try/except: its error is recorded and the section goes on. Timings follow
`benchmarks/strategies.py`: the wall time between optimizer steps after a warm-up (`StepTimer`), its median.

- ``peers``: `Parallel3DStrategy` 1x1x1 against Lightning's ``auto`` with the same `lit3d.GPT`, and against
  transformers' ``LlamaForCausalLM`` of the same shape in a plain PyTorch loop (same batches, same fused AdamW, SDPA),
  with ``torch.compile`` off and on (each block compiled alike: `apply_compile`).
- ``extras``: LoRA, ZeRO-3 with ``offload=True`` on one rank, a synchronous and an asynchronous checkpoint save (how
  long training blocks), a resume from the checkpoint, and ``lit3d generate`` tokens/s.
- ``fp8``: ``float8="tensorwise"`` and ``"rowwise"`` against bf16, on a wide model and on the peers' model.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

STARTED = time.time()
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402

from benchmarks.step_timer import StepTimer  # noqa: E402
from lit3d import GPT, GPTConfig, LoRA  # noqa: E402
from lit3d.hardware import GPUS, cpu_share, identify, unknown_device  # noqa: E402
from lit3d.strategies import Parallel3DStrategy  # noqa: E402
from lit3d.strategies.parallelize import apply_compile  # noqa: E402

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

    def run(self, item: str, function, *args: Any, estimate_s: float = 0.0, **kwargs: Any) -> dict[str, Any] | None:
        """``function(*args, **kwargs)``'s record under ``item``, or its error; skipped if the deadline is near."""
        left = self.settings["deadline"] - time.time()
        if left < estimate_s:
            self.skip(item, f"{left:.0f} s left of the time budget, ~{estimate_s:.0f} needed")
            return None
        print(f"[{item}] ...", flush=True)
        began = time.time()
        try:
            record = function(*args, **kwargs)
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


def free_memory() -> None:
    gc.collect()
    torch._dynamo.reset()  # NOTE: compiled code holds the last run's modules; a fresh run compiles (or hits the cache)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_flops() -> float:
    """Dense bf16 FLOP/s of this device (`lit3d.hardware`; a CPU: its cores' share), NaN when unknown."""
    if torch.cuda.is_available():
        gpu = identify(torch.cuda.get_device_name())
        return gpu.peak_tflops * 1e12 if gpu else math.nan
    return cpu_share(1).peak_tflops * 1e12


def batches(config: GPTConfig, micro: int, seq_len: int, count: int, repeat: bool = False) -> torch.Tensor:
    """``count`` micro-batches of random tokens ``[micro, seq_len + 1]``, stacked (the same for every run); with
    ``repeat``, one batch ``count`` times (a resumed run restarts its epoch: each step then sees the same batch)."""
    generator = torch.Generator().manual_seed(0)
    rows = micro if repeat else micro * count
    tokens = torch.randint(0, config.vocab_size, (rows, seq_len + 1), generator=generator)
    return tokens.repeat(count, 1) if repeat else tokens


def record(
    tokens_per_step: int, step_s: float, peak_bytes: int, config: GPTConfig, seq_len: int, adapters=None, **extra
) -> dict:
    tokens_per_s = tokens_per_step / step_s
    mfu = config.flops_per_token(seq_len, adapters) * tokens_per_s / peak_flops()  # the planner's FLOP count
    return {
        "tokens_per_s": round(tokens_per_s, 1),
        "step_s": step_s,
        "peak_gb": round(peak_bytes / 1e9, 3),
        "mfu": None if math.isnan(mfu) else round(mfu, 4),
        **extra,
    }


class CompiledBlocksGPT(GPT):
    """The GPT with each block compiled as `Parallel3DStrategy(compile=...)` compiles it (`apply_compile`):
    Lightning's own strategies leave compiling to the module."""

    compile_blocks: bool | str = False

    def configure_model(self) -> None:
        built = self.model is not None
        super().configure_model()
        if not built and self.compile_blocks and self.model is not None:
            apply_compile(list(self.model.blocks.values()), self.compile_blocks, checkpointed=False)


def fit(model: GPT, tokens: torch.Tensor, micro: int, settings: dict, strategy: Any, steps: int, **trainer: Any):
    """Train ``model`` on ``tokens`` for ``steps`` optimizer steps; the trainer and the step timer."""
    timer = StepTimer(str(Path("timer.json").resolve()), warmup=settings["warmup"])
    timer.on_train_batch_start = lambda *args: None  # NOTE: no saved-tensor hooks: a compiled step keeps its own
    options = dict(
        accelerator=settings["accelerator"],
        devices=1,
        precision="bf16-mixed",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=os.getcwd(),
        use_distributed_sampler=False,  # NOTE: every run the batches in their order (no strategy's shuffling)
    )
    ckpt_path = trainer.pop("ckpt_path", None)
    options.update(trainer)
    options["callbacks"] = [timer, *options.get("callbacks", [])]
    run = L.Trainer(strategy=strategy, **options)
    run.fit(model, torch.utils.data.DataLoader(tokens, batch_size=micro), ckpt_path=ckpt_path)
    return run, timer


def lightning_run(config: GPTConfig, micro: int, settings: dict, system: str, compile: bool | str, **extra) -> dict:
    """A lit3d GPT under `Parallel3DStrategy` 1x1x1 (``system="3d"``) or Lightning's ``auto``."""
    L.seed_everything(0, verbose=False)
    steps = settings["warmup"] + settings["steps"] + 1
    tokens = batches(config, micro, settings["seq_len"], steps)
    lora = extra.pop("lora", None)
    if system == "3d":
        model = GPT(config, warmup_steps=2, optimizer_impl="fused", lora=lora)
        strategy = Parallel3DStrategy(zero_stage=extra.pop("zero_stage", 0), compile=compile, **extra)
    else:
        model = CompiledBlocksGPT(config, warmup_steps=2, optimizer_impl="fused", lora=lora)
        model.compile_blocks, strategy = compile, "auto"
    _, timer = fit(model, tokens, micro, settings, strategy, steps)
    result = json.loads(Path(timer.path).read_text())
    return record(
        micro * settings["seq_len"],
        result["median_step_s"],
        result["peak_bytes"],
        config,
        settings["seq_len"],
        model.adapter_params,
        micro_batch=micro,
    )


def transformers_run(config: GPTConfig, micro: int, settings: dict, compile: bool | str) -> dict:
    """transformers' LlamaForCausalLM of the same shape in a plain loop: the same batches, fused AdamW with the GPT's
    groups and settings, bf16 autocast, SDPA attention, each decoder layer compiled as the GPT's blocks are."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lit3d.hf import config_to_hf

    torch.manual_seed(0)
    device = torch.device("cuda" if settings["accelerator"] == "gpu" else "cpu")
    hf = {k: v for k, v in config_to_hf(config, torch.float32).items() if k not in ("architectures", "torch_dtype")}
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**hf, use_cache=False, attn_implementation="sdpa"))
    model.train()
    if compile:
        apply_compile(list(model.model.layers), compile, checkpointed=False)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    steps = settings["warmup"] + settings["steps"] + 1
    tokens = batches(config, micro, settings["seq_len"], steps)
    times, last = [], None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()  # NOTE: where StepTimer resets it: before the first step
    for batch in tokens.split(micro):
        batch = batch.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    step_s = statistics.median(times[settings["warmup"] :])
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else state_bytes(model, optimizer)
    return record(micro * settings["seq_len"], step_s, peak, config, settings["seq_len"], micro_batch=micro)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, gradients and optimizer states (a CPU keeps no allocator peak): StepTimer's CPU figure."""
    tensors = [*model.parameters(), *(s for state in optimizer.state.values() for s in state.values())]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def with_smaller_batch(function, config: GPTConfig, micro: int, *args: Any, **kwargs: Any) -> dict:
    """``function(config, micro, ...)``, with three quarters of the micro-batch after an out-of-memory (noted in the
    record: the planner said the larger one fits)."""
    tried = micro
    while True:
        try:
            result = function(config, micro, *args, **kwargs)
            return result if micro == tried else {**result, "note": f"out of memory at micro-batch {tried}"}
        except torch.OutOfMemoryError:
            if micro == 1:
                raise
        free_memory()  # NOTE: here, past the except clause, whose traceback held the failed run's tensors
        micro = max(1, micro * 3 // 4)


def largest_micro_batch(config: GPTConfig, settings: dict, **given: Any) -> int:
    """The largest micro-batch whose plan fits this device (`lit3d.planner`, its headroom kept); a CPU's is set."""
    if settings["accelerator"] != "gpu":
        return settings["micro_batch"]
    from lit3d.planner import Cluster, Request, plan

    device = torch.cuda.get_device_name()
    gpu = identify(device) or GPUS["H100"]  # (memory is what matters here; the device's own is given)
    cluster = Cluster.of(gpu, 1, 1, gpu_memory_gb=torch.cuda.get_device_properties(0).total_memory / 1e9)
    fits = lambda micro: (
        plan(
            Request.given(
                config,
                cluster,
                seq_len=settings["seq_len"],
                micro_batch_size=micro,
                global_batch_size=micro,
                precision="bf16-mixed",
                tensor_parallel_size=1,
                pipeline_parallel_size=1,
                zero_stage=0,
                **given,
            )
        ).chosen.plan.fits
    )
    micro = 1
    while micro < 256 and fits(micro + 1):
        micro += 1
    return micro


def peers(section: Section) -> None:
    settings = section.settings
    config = GPTConfig(**settings["model"])
    micro = settings.get("micro_batch_found") or largest_micro_batch(config, settings)
    section.results["micro_batch"] = micro
    for compile in (False, settings["compile"]):
        estimate = settings["estimate_s"]["compiled" if compile else "eager"]
        on = "compile" if compile else "eager"
        first = section.run(
            f"3d {on}", with_smaller_batch, lightning_run, config, micro, settings, "3d", compile, estimate_s=estimate
        )
        if first and first.get("micro_batch"):  # the others at the micro-batch lit3d ran
            micro = section.results["micro_batch"] = first["micro_batch"]
        section.run(
            f"auto {on}",
            with_smaller_batch,
            lightning_run,
            config,
            micro,
            settings,
            "auto",
            compile,
            estimate_s=estimate,
        )
        section.run(
            f"transformers {on}",
            with_smaller_batch,
            transformers_run,
            config,
            micro,
            settings,
            compile,
            estimate_s=estimate,
        )


def fp8(section: Section) -> None:
    """FP8 against bf16, compiled as FP8 training runs: a wide model first (where FP8 pays), then the peers' one."""
    from lit3d.strategies.torch_compat import rowwise_float8_on_cpu

    settings = section.settings
    if settings["accelerator"] == "gpu" and tuple(torch.cuda.get_device_capability()) < (8, 9):
        section.results["skipped"] = (
            f"{torch.cuda.get_device_name()} has no FP8 tensor cores (compute capability < 8.9)"
        )
        section.write()
        return
    estimate = settings["estimate_s"]["compiled"]
    for shape in ("wide", "model"):
        config = GPTConfig(**settings["model" if shape == "model" else "fp8_model"])
        found = settings.get("micro_batch_found") if shape == "model" else None
        micro = found or min(largest_micro_batch(config, settings, compile=True), settings["fp8_micro_batch_cap"])
        for recipe in ([None] if shape == "wide" else []) + ["tensorwise", "rowwise"]:
            item = f"{shape} {recipe or 'bf16'}"
            if recipe == "rowwise" and settings["accelerator"] == "cpu" and not rowwise_float8_on_cpu():
                reason = f"PyTorch {torch.__version__}'s CPU FP8 matmul takes one scale per tensor (a GPU's: per row)"
                section.skip(item, reason)
                continue
            section.run(
                item,
                with_smaller_batch,
                lightning_run,
                config,
                micro,
                settings,
                "3d",
                settings["compile"],
                float8=recipe,
                estimate_s=estimate,
            )


def extras(section: Section) -> None:
    settings = section.settings
    config, side = GPTConfig(**settings["model"]), GPTConfig(**settings["side_model"])
    estimate = settings["estimate_s"]["eager"]
    lora = LoRA(rank=16, targets=("q", "k", "v", "o", "gate", "up", "down"))
    micro = settings.get("micro_batch_found") or largest_micro_batch(config, settings, lora=lora)
    section.run(
        "lora", with_smaller_batch, lightning_run, config, micro, settings, "3d", False, lora=lora, estimate_s=estimate
    )
    side_micro = settings["side_micro_batch"]
    section.run(
        "zero3 offload",
        lightning_run,
        side,
        side_micro,
        settings,
        "3d",
        False,
        zero_stage=3,
        offload=True,
        estimate_s=estimate,
    )
    work = Path.cwd()
    saved = section.run(
        "checkpoint sync", checkpoint_run, side, side_micro, settings, work / "sync.ckpt", False, estimate_s=estimate
    )
    background = section.run(
        "checkpoint async", checkpoint_run, side, side_micro, settings, work / "async.ckpt", True, estimate_s=estimate
    )
    if background and "losses" in background:
        section.run(
            "resume", resume_run, side, side_micro, settings, work / "async.ckpt", background, estimate_s=estimate
        )
    else:
        section.results["items"]["resume"] = {"skipped": "no asynchronous checkpoint to resume from"}
    source = work / ("async.ckpt" if (work / "async.ckpt").exists() else "sync.ckpt")
    if saved or background:
        section.run("generate", generate_run, source, settings, estimate_s=estimate)


class SaveAt(L.Callback):
    """Saves the checkpoint after optimizer step ``step`` and times how long training waits for it; records every
    step's loss."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path, self.blocked_s, self.losses = step, path, None, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if trainer.global_step == self.step:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            began = time.perf_counter()
            trainer.save_checkpoint(self.path)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.blocked_s = time.perf_counter() - began


def checkpoint_run(config: GPTConfig, micro: int, settings: dict, path: Path, asynchronous: bool) -> dict:
    """Train, save after step ``save_step`` (in the background with ``asynchronous``), train on: how long the save
    held training up, the steps' times after it, and every step's loss (for the resume to match)."""
    L.seed_everything(0, verbose=False)
    save_step, steps = settings["save_step"], settings["save_step"] + 3
    saver = SaveAt(save_step, path)
    model = GPT(config, warmup_steps=2, optimizer_impl="fused")
    strategy = Parallel3DStrategy(async_checkpoint=asynchronous)
    tokens = batches(config, micro, settings["seq_len"], steps, repeat=True)
    fit(model, tokens, micro, settings, strategy, steps, callbacks=[saver])  # (the end of training waits for it)
    if saver.blocked_s is None:
        raise RuntimeError(f"no checkpoint was saved at step {save_step}")
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
    return {"blocked_s": round(saver.blocked_s, 3), "checkpoint_gb": round(size / 1e9, 3), "losses": saver.losses}


def resume_run(config: GPTConfig, micro: int, settings: dict, path: Path, saved: dict) -> dict:
    """Resume from ``path`` on this device and train the steps the saving run trained after it: the same losses."""
    L.seed_everything(0, verbose=False)
    save_step, steps = settings["save_step"], settings["save_step"] + 3
    saver = SaveAt(-1, path)
    model = GPT(config, warmup_steps=2, optimizer_impl="fused")
    tokens = batches(config, micro, settings["seq_len"], steps, repeat=True)
    fit(model, tokens, micro, settings, Parallel3DStrategy(), steps, callbacks=[saver], ckpt_path=str(path))
    expected = saved["losses"][save_step:]
    difference = max(abs(a - b) for a, b in zip(saver.losses, expected))
    if len(saver.losses) != len(expected) or difference > settings["resume_tolerance"]:
        raise AssertionError(f"resumed losses {saver.losses} are not the saving run's {expected}")
    return {"losses": saver.losses, "expected": expected, "max_difference": difference}


def generate_run(path: Path, settings: dict) -> dict:
    """``lit3d generate`` from the checkpoint, for a few tokens and for ``generate_tokens`` more: the difference of
    the two wall times is the generation alone (loading the checkpoint is in both)."""
    from lit3d.commands import generate

    times, output = [], io.StringIO()
    for new in (1, 1 + settings["generate_tokens"]):
        began = time.perf_counter()
        with contextlib.redirect_stdout(output):
            generate(
                str(path),
                "def main():",
                max_new_tokens=new,
                temperature=0.0,
                tokenizer="byte",
                accelerator=settings["accelerator"],
            )
        times.append(time.perf_counter() - began)
    tokens_per_s = settings["generate_tokens"] / max(times[1] - times[0], 1e-9)
    return {
        "tokens_per_s": round(tokens_per_s, 1),
        "wall_s_1_token": round(times[0], 2),
        "printed": output.getvalue()[-200:],
    }


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
