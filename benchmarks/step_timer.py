"""A callback for the benchmarks: wall time of each optimizer step and memory, written by rank 0 at the end."""

import json
import time

import torch
from lightning.pytorch.callbacks import Callback

from lit3d.strategies.memory import memory_by_component


class StepTimer(Callback):
    """Records the time between consecutive training batches, then writes ``path`` (JSON) on rank 0.

    Memory: on GPUs the peak allocated during training; on CPUs (no allocator statistics) the bytes held in
    parameters, gradients and optimizer states just before the last step. Both are for the most loaded rank.

    Args:
        path: Where rank 0 writes the result.
        warmup: Steps left out of the statistics (first-step setup, allocator warm-up).
    """

    def __init__(self, path: str = "step_times.json", warmup: int = 3) -> None:
        self.path, self.warmup = path, warmup
        self.times: list[float] = []
        self._last: float | None = None
        self._state_bytes = 0

    def on_train_start(self, trainer, pl_module):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == trainer.max_steps - 1:
            self._state_bytes = memory_by_component(pl_module, trainer.optimizers)["total"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now

    def on_train_end(self, trainer, pl_module):
        local = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else self._state_bytes
        peak = trainer.strategy.reduce(torch.tensor(float(local), device=pl_module.device), reduce_op="max")
        if trainer.is_global_zero:
            steps = sorted(self.times[self.warmup :])
            with open(self.path, "w") as f:
                json.dump({"median_step_s": steps[len(steps) // 2], "steps": len(steps), "peak_bytes": int(peak)}, f)
