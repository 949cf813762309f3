"""The most bytes of live tensors one rank holds over a training step: what a GPU's allocator would have handed out
(``torch.cuda.max_memory_allocated`` less its rounding), measured on CPU ranks.

NOTE: not PyTorch's ``MemTracker`` (torch.distributed._tools.mem_tracker), though it works on CPU under gloo (its peak
of a DDP step is ours to the byte): it cannot tell gloo's own copies from what the run holds. Gloo's reduce-scatter
copies its whole input (measured: 4 MB for 1M fp32 elements; its all-reduce, all-gather and all-to-all copy nothing)
where NCCL reads the caller's buffer, so a CPU rank holds more than a GPU rank would. Those copies are storages made
while a collective of ``torch.distributed`` runs; they are measured apart (``collective_copies``) and left out of
``peak``.

Sizes are kept as running totals: a storage's bytes are added when an operation first returns it, read again when a
later operation returns or writes it, and taken off when it is freed. A storage an operation returns that was already
one of its inputs existed before (a view of a parameter, say) and may be resized where no dispatch mode sees it:
FSDP2 frees and refills its gathered parameters by resizing their storages (``resize_``). Those are read at every
operation. (Reading every storage at every operation was most of what measuring a small model's step cost.)
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

COLLECTIVES = "torch/distributed/distributed_c10d.py"
COLLECTIVE_DEPTH = 4  # frames looked through for it


class LiveTensors(TorchDispatchMode):
    """Every storage that an operation returns inside the mode, and those given to `hold`, weakly referenced, with
    the bytes they held when last read; ``peak``: the most held at once; ``collective_copies``: the most that
    storages made inside a collective held at once (gloo's copies, left out of ``peak``)."""

    def __init__(self) -> None:
        super().__init__()
        # by id: the storage, whether a collective made it, and its bytes when last read
        self._live: dict[int, list] = {}  # [the storage (weakly), made by a collective, bytes]
        self._resizable: set[int] = set()  # those that existed before an operation returned them
        self._effects_by_op: dict[Any, tuple[bool, bool]] = {}  # `_effects`, by operation
        self._held = {False: 0, True: 0}  # bytes now, by whether a collective made them
        self.peak = self.collective_copies = 0

    def hold(self, *tensors: torch.Tensor | None) -> None:
        """Tensors alive before the mode (parameters, gradients, optimizer states)."""
        for storage in (s for t in tensors if t is not None for s in storages(t)):
            if id(storage) not in self._live:
                self._add(storage, copy=False, resizable=False)

    def _add(self, storage: torch.UntypedStorage, copy: bool, resizable: bool) -> None:
        key, size = id(storage), storage.nbytes()
        ref = weakref.ref(storage, lambda _, key=key: self._forget(key))
        self._live[key] = [ref, copy, size]
        self._held[copy] += size
        if resizable:
            self._resizable.add(key)

    def _read(self, key: int) -> None:
        """The bytes of storage ``key`` read again (`_read_all`)."""
        self._read_all((key,))

    def _read_all(self, keys) -> None:
        """The bytes of the storages ``keys`` read again; none of those freed since the caller listed them (a garbage
        collection during the operation's bookkeeping frees storages). Inline: it runs after every operation."""
        live, held = self._live, self._held
        for key in keys:
            known = live.get(key)
            storage = known[0]() if known is not None else None
            if storage is not None and (size := storage.nbytes()) != known[2]:
                held[known[1]] += size - known[2]
                known[2] = size

    def _forget(self, key: int) -> None:
        _, made_by_collective, size = self._live.pop(key)
        self._held[made_by_collective] -= size
        self._resizable.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # NOTE: DTensor runs its local operations, which come back here
        out = func(*args, **(kwargs or {}))
        inputs = None
        writes, aliases = self._effects(func)
        if writes:  # written in place (``out=``, ``resize_``): read again
            inputs = _storage_ids((args, kwargs))
            self._read_all(inputs & self._live.keys())
        copy = None
        for storage in (s for t in _tensors(out) for s in storages(t)):
            key = id(storage)
            if key in self._live:
                self._read(key)
                continue
            if copy is None:
                copy = _inside_collective()
            if inputs is None:  # (only an operation that may return an input's storage is asked which they are)
                inputs = _storage_ids((args, kwargs)) if aliases else set()
            self._add(storage, copy, resizable=key in inputs)  # (an input's: it existed before)
        self._read_all(list(self._resizable))  # (a copy: freeing a storage here takes it off)
        self.peak = max(self.peak, self._held[False])
        self.collective_copies = max(self.collective_copies, self._held[True])
        return out

    def _effects(self, func) -> tuple[bool, bool]:
        """Whether ``func`` writes its inputs, and whether a result may share an input's storage (a view, an alias),
        from its schema; an operation without one is taken as doing both."""
        known = self._effects_by_op.get(func)
        if known is None:
            schema = getattr(func, "_schema", None)
            if schema is None:
                known = (True, True)
            else:
                known = (schema.is_mutable, schema.is_mutable or any(r.alias_info is not None for r in schema.returns))
            self._effects_by_op[func] = known
        return known


def storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``tensor``'s bytes: through a wrapper subclass (FP8's weights) to the tensors it wraps."""
    if is_traceable_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()
        return [storage for name in inner for storage in storages(getattr(tensor, name))]
    return [tensor.untyped_storage()] if isinstance(tensor, torch.Tensor) else []  # (not its mesh, say)


def _storage_ids(value: Any) -> set[int]:
    return {id(storage) for tensor in _tensors(value) for storage in storages(tensor)}


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an operation's arguments or results (tensors, lists and tuples of them, keyword dicts).
    NOTE: not `torch.utils._pytree.tree_flatten`, which took half of the mode's time per operation."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _inside_collective() -> bool:
    """Whether the Python code that ran the operation is a collective's (`COLLECTIVES`): the caller of the mode's
    caller, or a few frames out (its wrappers). NOTE: not the whole stack, which was a third of the mode's time."""
    frame = sys._getframe(2)
    for _ in range(COLLECTIVE_DEPTH):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(COLLECTIVES):
            return True
        frame = frame.f_back
    return False


class PeakMemory(L.Callback):
    """`LiveTensors` over optimizer step ``step`` (all its micro-batches): from the first batch's start to the last
    batch's end, with the parameters, gradients and optimizer states (ZeRO-1's master weights too) alive before it,
    and what ``held`` returns of the trainer's (a strategy's own state, alive before it too)."""

    def __init__(self, step: int = 2, held: Callable[[L.Trainer], list[torch.Tensor]] | None = None) -> None:
        self.step, self._mode, self.measured, self.held = step, None, {}, held  # (None: a job's callbacks pickle)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step or self._mode is not None or self.measured:
            return
        self._mode = LiveTensors()
        stepped = [p for optimizer in trainer.optimizers for group in optimizer.param_groups for p in group["params"]]
        states = [v for o in trainer.optimizers for state in o.state.values() for v in state.values()]
        parameters = [*pl_module.parameters(), *stepped]
        self._mode.hold(*parameters, *(p.grad for p in parameters), *(v for v in states if torch.is_tensor(v)))
        self._mode.hold(*(self.held(trainer) if self.held is not None else []))
        self._mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._mode is not None and trainer.global_step > self.step:
            self._mode.__exit__(None, None, None)
            self.measured = {"peak": self._mode.peak, "collective_copies": self._mode.collective_copies}
            self._mode = None

    def results(self) -> dict:
        return {"peak_memory": self.measured}
