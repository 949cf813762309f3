"""Sharded saves written in the background (`Parallel3DStrategy(async_checkpoint=True)`), with DCP's `async_save`.

Training waits only while DCP stages this rank's shards into host memory (a copy: the parameters go on changing);
a thread then writes them. The guarantees of the synchronous save (`lit3d.checkpoint.folder.save`) hold:

- the folder appears complete or not at all: shards go to ``<folder>.partial``, and rank 0 writes the rest of the
  checkpoint, checks the folder and renames it into place only once DCP has gathered every rank's writes (its
  metadata is the last file written);
- at most one save is in flight: the next save, a load, and the end of training wait for it;
- a background write that fails is raised on every rank at the next save or at the end of training, naming the
  folder: never lost silently.

NOTE: the background writes and DCP's gathering of their results go over a gloo process group of their own, so
they never interleave with the training's collectives on the main thread.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lit3d.checkpoint.folder import PARTIAL_SUFFIX, prepare_partial, publish
from lit3d.checkpoint.safe_io import META_FILE, check_readable


class BackgroundSaves:
    """At most one sharded save in flight. Every rank calls `start` and `wait` (collectives)."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.pending: Future | None = None
        self.path: Path | None = None
        self.blocked_s: list[float] = []  # how long each `start` held training up

    def start(self, path: Path, tensors: dict[str, Any], meta: dict[str, Any], is_global_zero: bool) -> None:
        """Stage ``tensors`` and write them in the background; rank 0 publishes the folder when all are written."""
        self.wait()
        began = time.perf_counter()
        partial = prepare_partial(path, is_global_zero)
        future = dcp.async_save(tensors, checkpoint_id=str(partial), process_group=self.group)
        if is_global_zero:
            future = _then(future, lambda: _finish(path, partial, meta))
        self.pending, self.path = future, path
        self.blocked_s.append(time.perf_counter() - began)

    def wait(self, agree: bool = True) -> None:
        """Block until the save in flight is written and published; raise on every rank if any rank's failed.
        ``agree=False``: only this rank's write, no collective (after an error elsewhere, peers may be gone)."""
        if self.pending is None:
            return
        pending, path, self.pending = self.pending, self.path, None
        error: BaseException | None = None
        try:
            pending.result()
        except BaseException as caught:  # DCP's CheckpointException is a BaseException
            error = caught
        ranks = [dist.get_rank() if dist.is_initialized() else 0] if error is not None else []
        if agree and dist.is_initialized():  # every rank learns which ranks failed, so all raise together
            mine = torch.tensor([float(error is not None)])
            every = [torch.zeros(1) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine, group=self.group)
            ranks = [rank for rank, failed in enumerate(every) if failed.item()]
        if ranks:
            where = f"on rank(s) {ranks}"
            raise RuntimeError(
                f"the background save of checkpoint {str(path)!r} failed {where}"
                + (f": {type(error).__name__}: {error}" if error is not None else " (see that rank's log)")
                + f"; the folder was not published (what was written is in {str(path) + PARTIAL_SUFFIX!r})"
            ) from error


def _finish(path: Path, partial: Path, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank's shards are written: the rest of the checkpoint, a check, the rename."""
    torch.save(meta, partial / META_FILE)
    check_readable(partial)
    publish(path, partial)


def _then(future: Future, step: Any) -> Future:
    """A future that resolves after ``future`` and then ``step()`` (in the writing thread), or with either's error."""
    chained: Future = Future()

    def run(done: Future) -> None:
        try:
            done.result()
            step()
            chained.set_result(None)
        except BaseException as error:
            chained.set_exception(error)

    future.add_done_callback(run)
    return chained
