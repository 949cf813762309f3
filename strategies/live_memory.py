"""The most bytes of live tensors one rank holds over a training step: what a GPU's allocator would have handed out
(``torch.cuda.max_memory_allocated`` less its rounding), measured on CPU ranks.

NOTE: not PyTorch's ``MemTracker`` (torch.distributed._tools.mem_tracker), though it works on CPU under gloo (its peak
of a DDP step is ours to the byte): it cannot tell gloo's own copies from what the run holds. Gloo's reduce-scatter
copies its whole input (measured: 4 MB for 1M fp32 elements; its all-reduce, all-gather and all-to-all copy nothing)
where NCCL reads the caller's buffer, so a CPU rank holds more than a GPU rank would. Those copies are storages made
while a collective of ``torch.distributed`` runs; they are measured apart (``collective_copies``) and left out of
``peak``. Each storage's size is read at every operation rather than when it is made, because FSDP2 frees and
refills its gathered parameters by resizing their storages (``resize_``, which no dispatch mode sees).
"""

from __future__ import annotations

import sys
import weakref

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

COLLECTIVES = "torch/distributed/distributed_c10d.py"


class LiveTensors(TorchDispatchMode):
    """Every storage that an operation returns inside the mode, and those given to `hold`, weakly referenced; after
    each operation, the bytes of those still alive. ``peak``: the most held at once; ``collective_copies``: the
    most that storages made inside a collective held at once (gloo's copies, left out of ``peak``)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[weakref.ref, bool]] = {}  # by id: the storage, whether a collective made it
        self.peak = self.collective_copies = 0

    def hold(self, *tensors: torch.Tensor | None) -> None:
        """Tensors alive before the mode (parameters, gradients, optimizer states)."""
        for tensor in tensors:
            if tensor is not None:
                self._add(tensor, copy=False)

    def _add(self, tensor: torch.Tensor, copy: bool) -> None:
        for storage in storages(tensor):
            key = id(storage)
            if key not in self._live:
                self._live[key] = (weakref.ref(storage, lambda _, key=key: self._live.pop(key, None)), copy)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # NOTE: DTensor runs its local operations, which come back here
        out = func(*args, **(kwargs or {}))
        copy = _inside_collective()
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor, copy)
        held = copies = 0
        for ref, made_by_collective in list(self._live.values()):
            storage = ref()
            if storage is not None:
                if made_by_collective:
                    copies += storage.nbytes()
                else:
                    held += storage.nbytes()
        self.peak, self.collective_copies = max(self.peak, held), max(self.collective_copies, copies)
        return out


def storages(tensor: torch.Tensor) -> set[torch.UntypedStorage]:
    """The storages holding ``tensor``'s bytes: through a wrapper subclass (FP8's weights) to the tensors it wraps."""
    if is_traceable_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()
        return {storage for name in inner for storage in storages(getattr(tensor, name))}
    return {tensor.untyped_storage()} if isinstance(tensor, torch.Tensor) else set()  # (not its mesh, say)


def _inside_collective() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(COLLECTIVES):
            return True
        frame = frame.f_back
    return False


class PeakMemory(L.Callback):
    """`LiveTensors` over optimizer step ``step`` (all its micro-batches): from the first batch's start to the last
    batch's end, with the parameters, gradients and optimizer states (ZeRO-1's master weights too) alive before it."""

    def __init__(self, step: int = 2) -> None:
        self.step, self._mode, self.measured = step, None, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step or self._mode is not None or self.measured:
            return
        self._mode = LiveTensors()
        stepped = [p for optimizer in trainer.optimizers for group in optimizer.param_groups for p in group["params"]]
        states = [v for o in trainer.optimizers for state in o.state.values() for v in state.values()]
        parameters = [*pl_module.parameters(), *stepped]
        self._mode.hold(*parameters, *(p.grad for p in parameters), *(v for v in states if torch.is_tensor(v)))
        self._mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._mode is not None and trainer.global_step > self.step:
            self._mode.__exit__(None, None, None)
            self.measured = {"peak": self._mode.peak, "collective_copies": self._mode.collective_copies}
            self._mode = None

    def results(self) -> dict:
        return {"peak_memory": self.measured}
