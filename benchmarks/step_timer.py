"""A callback for the benchmarks: wall time of each optimizer step and memory, written by rank 0 at the end."""

import json
import time

import torch
from lightning.pytorch.callbacks import Callback

from lit3d.strategies.telemetry.held_memory import memory_by_component


class StepTimer(Callback):
    """Records the time between consecutive training batches, then writes ``path`` (JSON) on rank 0.

    Memory: on GPUs the peak allocated during training; on CPUs (no allocator statistics) the bytes held in
    parameters, gradients and optimizer states just before the last step. Both are for the most loaded rank.
    Also ``activation_bytes``: what autograd keeps at the end of one forward (saved-tensor hooks, each storage
    once, parameters left out), on the most loaded rank, measured in a warm-up step that the timing leaves out.

    Args:
        path: Where rank 0 writes the result.
        warmup: Steps left out of the statistics (first-step setup, allocator warm-up).
    """

    def __init__(self, path: str = "step_times.json", warmup: int = 3) -> None:
        self.path, self.warmup = path, warmup
        self.times: list[float] = []
        self._last: float | None = None
        self._state_bytes = 0
        self._activation_bytes = 0
        self._saved: dict[int, int] | None = None
        self._hooks = None

    def on_train_start(self, trainer, pl_module):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 1 and self.warmup >= 2 and self._hooks is None:
            params = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in pl_module.parameters()}
            self._saved = {}

            def pack(tensor):
                local = getattr(tensor, "_local_tensor", tensor)
                try:
                    key, size = local.untyped_storage().data_ptr(), local.untyped_storage().nbytes()
                except RuntimeError:  # a tensor subclass without a storage of its own: its elements
                    key, size = id(local), local.numel() * local.element_size()
                if key not in params:
                    self._saved[key] = size
                return tensor

            self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
            self._hooks.__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        if self._hooks is not None and self._saved is not None:
            self._hooks.__exit__(None, None, None)
            self._activation_bytes, self._saved = sum(self._saved.values()), None

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
        mine = torch.tensor([float(local), float(self._activation_bytes)], device=pl_module.device)
        peak, activations = trainer.strategy.reduce(mine, reduce_op="max").tolist()
        if trainer.is_global_zero:
            steps = sorted(self.times[self.warmup :])  # (none where the run was no longer than its warm-up)
            median = steps[len(steps) // 2] if steps else None
            result = {"median_step_s": median, "steps": len(steps), "peak_bytes": int(peak)}
            with open(self.path, "w") as f:
                json.dump({**result, "activation_bytes": int(activations)}, f)
