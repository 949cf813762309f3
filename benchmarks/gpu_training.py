"""The training runs `benchmarks/gpu_runs.py` measures: lit3d under `Parallel3DStrategy` or Lightning's ``auto``,
transformers' ``LlamaForCausalLM`` in a plain loop, a checkpoint saved and resumed, ``lit3d generate``. Each returns
its record (tokens/s, the median step, peak memory, MFU by the planner's FLOP count, ...) and leaves nothing running.
Timings follow `benchmarks/strategies.py`: the wall time between optimizer steps after a warm-up (`StepTimer`)."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from benchmarks.step_timer import StepTimer
from lit3d import GPT, GPTConfig
from lit3d.planner.hardware import GPUS, cpu_share, identify
from lit3d.strategies import Parallel3DStrategy
from lit3d.strategies.parallelize import apply_compile


def free_memory() -> None:
    """Drop what the last run left: its objects, its compiled code, the allocator's cache and its peak."""
    gc.collect()
    torch._dynamo.reset()  # NOTE: compiled code holds the last run's modules; a fresh run compiles (or hits the cache)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_flops() -> float:
    """Dense bf16 FLOP/s of this device (`lit3d.planner.hardware`; a CPU: its cores' share), NaN when unknown."""
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
    """A run's record: tokens/s, its median step, peak memory and MFU (``adapters``: LoRA's, `GPT.adapter_params`)."""
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


class StepTimes(StepTimer):
    """`StepTimer` without its count of the activations autograd keeps: its saved-tensor hooks would be traced into
    the compiled runs' step, and only the step times and peak memory are read here."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        pass


def fit(model: GPT, tokens: torch.Tensor, micro: int, settings: dict, strategy: Any, steps: int, **trainer: Any):
    """Train ``model`` on ``tokens`` for ``steps`` optimizer steps; the trainer and the step timer."""
    timer = StepTimes(str(Path("timer.json").resolve()), warmup=settings["warmup"])
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

    from lit3d.hf.folders import config_to_hf

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
    step_s = sorted(times[settings["warmup"] :])[(len(times) - settings["warmup"]) // 2]  # (StepTimer's median)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else state_bytes(model, optimizer)
    return record(micro * settings["seq_len"], step_s, peak, config, settings["seq_len"], micro_batch=micro)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, gradients and optimizer states (a CPU keeps no allocator peak): StepTimer's CPU figure."""
    tensors = [*model.parameters(), *(s for state in optimizer.state.values() for s in state.values())]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def with_smaller_batch(train: Callable[[int], dict], micro: int) -> dict:
    """``train(micro)``, with three quarters of the micro-batch after an out-of-memory (noted in the record: the
    planner said the larger one fits)."""
    tried = micro
    while True:
        try:
            result = train(micro)
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
    held training up, and every step's loss (for the resume to match)."""
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
    """``lit3d generate`` from the checkpoint, for one token and for ``generate_tokens`` more: the difference of the
    two wall times is the generation alone (loading the checkpoint is in both), after a first call that warms up."""
    from lit3d.cli.commands import generate

    times, output, more = [], io.StringIO(), settings["generate_tokens"]
    for new in (1 + more, 1 + more, 1):  # (the first warms up: a new length first costs more, on CPU and GPU)
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
    generating, printed = times[1] - times[2], output.getvalue()[-200:]
    if generating <= 0:  # (a machine too noisy to tell them apart)
        note = f"{more} tokens took no longer than 1 ({times[1]:.2f} s, {times[2]:.2f} s)"
        return {"tokens_per_s": None, "note": note, "printed": printed}
    return {"tokens_per_s": round(more / generating, 1), "load_s": round(times[2], 2), "printed": printed}
