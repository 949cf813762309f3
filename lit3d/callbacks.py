"""Callbacks that show what training is doing."""

from __future__ import annotations

import time

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, Callback, RichProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit3d.model_summary import ModelSummary  # noqa: F401 (its home is lit3d.model_summary; configs name it here)
from lit3d.models.documents import attended_length
from lit3d.models.generation import Sampling
from lit3d.models.loop import ends_optimizer_step
from lit3d.planner.hardware import identify


class SampleText(Callback):
    """After each validation run, decode a short sample from the model, so a user sees it learn.

    Every rank generates (model-parallel layouts need all ranks in each forward) with the same seeded
    generator, so all ranks feed the same tokens; rank 0 prints.

    Args:
        prompt: Text the sample starts from.
        max_new_tokens: Tokens to generate.
        temperature: Sampling temperature (0 is greedy).
        top_k: Sample among the k most likely tokens only.
        seed: Seed of the sampling generator (the global RNG is left untouched).
    """

    def __init__(
        self,
        prompt: str = "def ",
        max_new_tokens: int = 64,
        temperature: float = 0.8,
        top_k: int | None = 40,
        seed: int = 0,
    ) -> None:
        self.prompt, self.max_new_tokens, self.temperature, self.top_k, self.seed = (
            prompt,
            max_new_tokens,
            temperature,
            top_k,
            seed,
        )

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        if trainer.sanity_checking or tokenizer is None or not hasattr(pl_module, "generate"):
            return

        prompt = torch.as_tensor(tokenizer.encode_batch([self.prompt])[0], dtype=torch.long, device=pl_module.device)
        generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
        sampling = Sampling(self.max_new_tokens, self.temperature, self.top_k, seed=self.seed)
        tokens = pl_module.generate(prompt, sampling, generator=generator)
        if trainer.is_global_zero:
            text = tokenizer.decode(tokens.tolist())
            message = f"\n--- sample at step {trainer.global_step} ---\n{text}\n---"
            bar = trainer.progress_bar_callback
            bar.print(message) if bar is not None else print(message)


class PrintCompletions(BasePredictionWriter):
    """Print each prompt and its continuation (`GPT.predict_step`'s output) as it is generated, decoded with the
    datamodule's tokenizer; rank 0 prints (it holds the whole tokens in every layout).

    Args:
        prompt: Print the prompt before its continuation; ``False``: the continuation alone (a chat's answer).
    """

    def __init__(self, prompt: bool = True) -> None:
        super().__init__(write_interval="batch")
        self.prompt = prompt

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        if not trainer.is_global_zero or tokenizer is None or not isinstance(prediction, dict):
            return
        prompt, completion = prediction["prompt"].tolist(), prediction["completion"].tolist()
        print((tokenizer.decode(prompt) if self.prompt else "") + tokenizer.decode(completion), flush=True)


class Throughput(Callback):
    """Tokens/s, samples/s, step time, peak memory and MFU of every optimizer step, in the progress bar and the logger.

    Logged (rank 0's clock, which every rank waits for at the step's collectives): ``perf/tokens_per_s`` (global),
    ``perf/tokens_per_s_per_device``, ``perf/samples_per_s``, ``perf/step_s``, ``perf/peak_memory_gb`` (the
    device allocator's peak on GPUs, the process's peak resident memory on CPU) and ``perf/mfu``: model FLOPs
    per token (`GPTConfig.flops_per_token`, no recompute; with LoRA, no gradient of the frozen weights) times
    tokens/s per device, over the device's dense bf16 peak from `lit3d.planner.hardware`; for packed documents
    (`lit3d.models.documents`) attention counts only the keys a token's own document holds (the mean document length
    a token sits in, from the step's last micro-batch, instead of the sequence length). A device that is not in that
    table (a CPU, an unknown GPU) reports no MFU rather than a wrong one. The first ``warmup`` steps (compilation,
    allocator warm-up) are not logged.

    Args:
        warmup: Optimizer steps to skip before logging.
    """

    def __init__(self, warmup: int = 2) -> None:
        self.warmup = warmup
        self._last: float | None = None
        self.peak_flops: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.peak_flops = device_peak_flops(pl_module.device)
        if self.peak_flops is None and pl_module.device.type == "cuda":  # a GPU the table lacks: said, by its name
            from lit3d.planner.hardware import unknown_device

            rank_zero_warn(unknown_device(torch.cuda.get_device_name(pl_module.device)))
        self._last = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if not ends_optimizer_step(trainer):
            return  # not an optimizer step yet
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter()
        last, self._last = self._last, now
        if last is None or trainer.global_step <= self.warmup:
            return
        step = now - last
        samples, seq_len = _global_batch_shape(trainer, batch)
        if samples is None:
            return
        tokens = samples * seq_len
        metrics = {
            "perf/tokens_per_s": tokens / step,
            "perf/tokens_per_s_per_device": tokens / step / trainer.world_size,
            "perf/samples_per_s": samples / step,
            "perf/step_s": step,
            "perf/peak_memory_gb": _peak_memory_bytes(pl_module.device) / 1e9,
        }
        config = getattr(pl_module, "config", None)
        if self.peak_flops and hasattr(config, "flops_per_token"):
            adapters = getattr(pl_module, "adapter_params", None)  # LoRA: the frozen weights get no gradient
            flops = config.flops_per_token(seq_len, adapters)
            if isinstance(batch, dict) and "positions" in batch:  # packed documents: the attention the mask keeps
                attended = attended_length(batch["positions"][:, :-1])
                flops += config.attention_flops_per_token(attended) - config.attention_flops_per_token(seq_len)
            metrics["perf/mfu"] = flops * metrics["perf/tokens_per_s_per_device"] / self.peak_flops
        for name, value in metrics.items():
            pl_module.log(
                name,
                value,
                prog_bar=name in ("perf/tokens_per_s", "perf/mfu"),
                rank_zero_only=True,
                on_step=True,
                on_epoch=False,
            )


class RichProgress(RichProgressBar):
    """Lightning's `RichProgressBar`, read sensibly when steps bound training: ``Epoch 3`` where Lightning's shows
    ``Epoch 3/-2`` (``max_epochs=-1``, the trainer's value when ``max_steps`` is given alone); and after a resume in
    the middle of an epoch, ``70/70`` where Lightning's shows ``70/10``: the count goes on from the epoch's batches
    done before the resume, so the total counts them too."""

    _total_at_start: float | None = None  # the bar's total as the fit starts (a resume restored), until a batch ends

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._total_at_start = self.total_train_batches

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        total, self._total_at_start = self._total_at_start, None
        resumed = total is not None and total != float("inf") and batch_idx > 0  # the fit's first batch, mid-epoch
        if resumed and self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, total=batch_idx + total)
            self.refresh()

    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        # NOTE: padded to the validation bar's description, as Lightning's is, so the bars do not flicker.
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"


_AXIS_NAMES = {"tensor_parallel": "tp", "data_parallel": "dp"}  # ModelParallelStrategy's mesh dims


class CommReport(Callback):
    """Bytes sent per mesh axis during one optimizer step, measured, next to the planner's estimate.

    The step runs under `lit3d.strategies.telemetry.comm.CommBytes` (PyTorch's `CommDebugMode`, weighing each collective
    by what a ring makes a rank send). Each axis reports its busiest rank, as the planner does (``plan.
    communication_per_step``, available under `Parallel3DStrategy` with a lit3d GPT). Rank 0 prints the table;
    ``comm/<axis>_mb`` goes to the logger. Strategies without a device mesh (``ddp``, ``fsdp``) are plain data
    parallel: their traffic is reported as ``dp``. Under DiLoCo the outer steps' traffic between islands is the
    ``island`` axis; measure ``steps=sync_every`` steps to see its mean per step, as the planner counts it. With
    replica groups (torchft) their average, over torchft's groups outside the run's world, is the ``replica`` axis. With
    HSDP's shard groups (``data_parallel_shard_size``) ``dp`` is two axes: ``dp_shard``, ZeRO's traffic within each
    group, and ``dp_replicate``, the groups' all-reduce of their shards.

    Args:
        step: The optimizer step to measure; later than the first, whose setup may communicate more.
        verbose: Print the table on rank 0.
        steps: Measure this many optimizer steps from ``step`` on, and report the mean per step.
    """

    def __init__(self, step: int = 2, verbose: bool = True, steps: int = 1) -> None:
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"CommReport(step={step!r}): the step to measure must be an integer >= 0")
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"CommReport(steps={steps!r}): the steps to measure must be an integer >= 1")
        self.step, self.steps, self.verbose = step, steps, verbose
        self.measured: dict[str, float] | None = None  # bytes, busiest rank per axis
        self.planned: dict[str, float] | None = None
        self._mode = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.measured = self.planned = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        if trainer.global_step == self.step and self._mode is None and self.measured is None:
            from lit3d.strategies.telemetry.comm import CommBytes

            self._mode = CommBytes().__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if self._mode is None or trainer.global_step < self.step + self.steps:
            return  # still inside the measured steps (gradient accumulation)
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        meshes = getattr(trainer.strategy, "meshes", None)  # `ParallelMeshes` (Parallel3DStrategy)
        mesh = getattr(trainer.strategy, "device_mesh", None) if meshes is None else None  # ModelParallelStrategy
        parallelism = getattr(trainer.strategy, "parallelism", None)
        replica = (getattr(parallelism, "replica_groups", None) or 1) > 1  # torchft's groups: their own axis
        if meshes is not None:
            local = mode.by_axis(meshes, outside="replica" if replica else "other")
        elif mesh is not None:
            local = mode.by_axis_of_mesh(mesh)
        else:
            local = {"dp": sum(mode.bytes_by_group.values())}
        layout = getattr(trainer.strategy, "layout", None)
        islands = getattr(layout, "islands", 1) > 1
        dp = ("dp_shard", "dp_replicate") if getattr(layout, "dp_replicate", 1) > 1 else ("dp",)  # HSDP: two axes
        axes = ("tp", "pp", *dp, "ep", "cp", *(("island",) if islands else ()), *(("replica",) if replica else ()),
                "other")  # fmt: skip
        local = {_AXIS_NAMES.get(axis, axis): sent / self.steps for axis, sent in local.items()}
        sent = torch.tensor([float(local.get(axis, 0.0)) for axis in axes], dtype=torch.float64)
        busiest = trainer.strategy.reduce(sent.to(pl_module.device), reduce_op="max").cpu().tolist()
        self.measured = dict(zip(axes, busiest))
        plan = getattr(trainer.strategy, "plan", None)
        self.planned = {axis: plan.communication_per_step[axis]["bytes"] for axis in axes[:-1]} if plan else None
        for axis in axes:
            pl_module.log(
                f"comm/{axis}_mb", self.measured[axis] / 2**20, rank_zero_only=True, on_step=True, on_epoch=False
            )
        if trainer.is_global_zero and self.verbose:
            print(format_comm_report(self.measured, self.planned, self.step, self.steps), flush=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.measured is None:
            rank_zero_warn(
                f"CommReport measured nothing: training ended before step {self.step} finished "
                f"(max_steps={trainer.max_steps})"
            )


def format_comm_report(measured: dict[str, float], planned: dict[str, float] | None, step: int, steps: int = 1) -> str:
    """The table `CommReport` prints: MiB per axis, measured and planned, and their ratio."""
    where = f"step {step}" if steps == 1 else f"steps {step}-{step + steps - 1}, the mean per step"
    width = max(6, *(len(axis) + 1 for axis in measured))  # (HSDP's dp_replicate)
    lines = [
        f"communication in {where}, MiB sent by the busiest rank per axis:",
        f"  {'axis':<{width}}{'measured':>10}{'planner':>10}{'ratio':>8}",
    ]
    for axis, sent in measured.items():
        plan = (planned or {}).get(axis)
        planner = "-" if plan is None else f"{plan / 2**20:.3f}"
        ratio = f"{sent / plan:.3f}" if plan else "-"
        lines.append(f"  {axis:<{width}}{sent / 2**20:>10.3f}{planner:>10}{ratio:>8}")
    return "\n".join(lines)


def device_peak_flops(device: torch.device) -> float | None:
    """Dense bf16 FLOP/s of a known GPU; None for a CPU or a GPU not in `lit3d.planner.hardware`."""

    gpu = identify(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return gpu.peak_tflops * 1e12 if gpu else None


def _global_batch_shape(trainer: L.Trainer, batch) -> tuple[int | None, int | None]:
    """Sequences per optimizer step over all replicas and tokens per sequence: from a lit3d TextDataModule, or
    from a ``[batch, seq_len + 1]`` token tensor and the number of data-parallel replicas."""
    data = trainer.datamodule
    if hasattr(data, "global_batch_size") and hasattr(data, "seq_len"):
        return data.global_batch_size, data.seq_len
    if isinstance(batch, torch.Tensor) and batch.ndim == 2:
        replicas = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        return batch.shape[0] * replicas.get("num_replicas", 1) * trainer.accumulate_grad_batches, batch.shape[1] - 1
    return None, None


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
