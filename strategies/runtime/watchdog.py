"""When a rank fails or stops making progress, the log says which rank and where.

How each way a rank can die ends the job (every rank gone, a non-zero exit), and what names it:

- **killed** (SIGKILL, the Linux OOM killer): its peers' next collective fails at once on gloo (the connection
  closes); the launcher ends the others (Lightning's observer SIGKILLs them within its 5 s poll; ranks started by
  `lit3d.strategies.runtime.launchers` exit within 1 s of rank 0; torchrun and ``srun --kill-on-bad-exit`` do the same).
- **an exception in one rank** (out of memory included: ``torch.OutOfMemoryError`` on GPUs, "can't allocate
  memory" on CPU): the same, and `describe_failure` logs the rank, the step and the exception first.
- **a hung collective** (a rank that never arrives): its peers wait ``timeout`` (the strategy's argument), then
  their collective raises and the job ends as above. gloo's error ("Timed out waiting 600000ms for recv
  operation") names neither the rank nor the collective, so each rank runs a `Watchdog`: at 90 % of ``timeout``
  without progress it logs where its main thread is, the collective it waits in and the line that called it.
  The rank that is *not* in a collective is the one the others wait for. On GPUs NCCL's own watchdog also names
  the collective (``WorkNCCL(SeqNum=..., OpType=...)``) and aborts the rank.

NOTE: the watchdog only reports, it never ends a rank: a step may legitimately run longer than ``timeout`` (a
first compile of a large model) while no collective waits, and ending a healthy job is worse than a late one.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from lit3d.errors import ConfigurationError

log = logging.getLogger(__name__)
TORCH = str(Path(__import__("torch").__file__).parent)
DISTRIBUTED = str(Path(TORCH) / "distributed")
STDLIB = str(Path(threading.__file__).parent)
# torch.distributed's functions that wait for peers (a frame in any other is "a torch.distributed call")
COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "all_to_all",
    "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv", "gather", "scatter", "reduce", "wait",
    "wait_tensor", "_wait", "new_group", "new_subgroups_by_enumeration", "init_process_group",
})  # fmt: skip
BATCHES = {"train": "training", "validate": "validation", "sanity_check": "validation", "predict": "prediction"}


def where(frames: list[traceback.FrameSummary]) -> str:
    """``torch.distributed`` call ``name`` (``module``), called from ``file:line (function)``: the innermost
    ``torch.distributed`` frame (the collective or its wait) and the innermost frame of the code that called it
    (lit3d's or the user's, not torch's or Python's own)."""
    collective = next((f for f in reversed(frames) if f.filename.startswith(DISTRIBUTED)), None)
    caller = next((f for f in reversed(frames) if not f.filename.startswith((TORCH, STDLIB))), None)
    parts = []
    if collective is not None:
        module = Path(collective.filename).relative_to(TORCH).with_suffix("").as_posix().replace("/", ".")
        kind = "collective" if collective.name in COLLECTIVES else "torch.distributed call"
        parts.append(f"in {kind} {collective.name} (torch.{module})")
    if caller is not None:
        parts.append(f"{'called from' if collective else 'in'} {_at(caller)}")
    elif frames:
        parts.append(f"in {_at(frames[-1])}")
    return ", ".join(parts)


def _at(frame: traceback.FrameSummary) -> str:
    """``folder/file.py:line (function)``: the file from its package's folder on, not the whole path."""
    return f"{'/'.join(Path(frame.filename).parts[-2:])}:{frame.lineno} ({frame.name})"


def describe_failure(rank: int, world: int, step: int, exception: BaseException) -> str:
    """One line naming the failed rank, its step, the collective it failed in (if any) and the exception."""
    frames = traceback.extract_tb(exception.__traceback__)
    place = where(frames) if frames else ""
    first_line = (str(exception).strip().splitlines() or [""])[0]
    return (
        f"rank {rank} of {world} failed in step {step}{', ' + place if place else ''}: "
        f"{type(exception).__name__}: {first_line}"
    )


def report_failure(rank: int, world: int, trainer: Any, exception: BaseException) -> None:
    """Log `describe_failure`'s line (the strategy's ``on_exception``) for a failed rank: neither a preemption exit
    nor a configuration refused before any rank ran is one (the launching process has no ``trainer`` yet)."""
    if not isinstance(exception, SystemExit | KeyboardInterrupt | ConfigurationError):
        log.error(describe_failure(rank, world, trainer.global_step if trainer is not None else 0, exception))


def batch_kind(stage: Any) -> str:
    """``"training"``, ``"validation"``, ... of a Lightning ``RunningStage``, for the beat at each batch."""
    return BATCHES.get(stage.value, stage.value) if stage else ""


class Watchdog:
    """A daemon thread that logs where this rank's main thread is once it has made no progress (no `beat`) for
    ``report_after`` seconds, once per stall."""

    def __init__(self, rank: int, timeout_s: float, poll_s: float = 1.0) -> None:
        self.rank, self.timeout_s, self.poll_s = rank, timeout_s, poll_s
        self.report_after = 0.9 * timeout_s
        self._last, self._doing = time.monotonic(), "start"
        self._reported = False
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, doing: str) -> None:
        """Progress: the main thread is now ``doing`` (e.g. "training step 12")."""
        self._last, self._doing, self._reported = time.monotonic(), doing, False

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="lit3d-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the watch and wait for its thread (nothing of a fit outlives it)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def stall_report(self) -> str | None:
        """The report due now (and marks it given), or None while the rank makes progress."""
        idle = time.monotonic() - self._last
        if self._reported or idle < self.report_after:
            return None
        self._reported = True
        frame = sys._current_frames().get(self._main)
        place = where(traceback.extract_stack(frame)) if frame is not None else "(main thread not found)"
        return (
            f"rank {self.rank}: no progress for {idle:.0f} s since {self._doing} (collectives time out after "
            f"{self.timeout_s:.0f} s); the rank is {place}"
        )

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            report = self.stall_report()
            if report is not None:
                log.error(report)
