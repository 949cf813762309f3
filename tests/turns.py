"""Several ranks' runs take turns on the machine: one at a time across the suite's xdist workers.

NOTE: ranks that run in lock step (every collective waits for each of them) slow down far more than their share when
they share 2 cores with another group of ranks: each collective waits until every rank of the group has been scheduled
again. Measured here: the two-node torchrun test took 30 s alone, 40 s beside one busy process, and 288 s in a suite
run beside the shared layout runs' spawns. A test or a spawned job that starts several ranks holds the machine's turn
(an exclusive `fcntl.flock` on one file for the whole session); single-process tests run beside it as before.
Each holder writes one line into that file (what held it, seconds waited, seconds held, when it let go), which the
suite's summary adds up (`held`): the time the multi-rank runs take one after another, the floor under the suite's time.
"""

import fcntl
import os
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

LOCK_VARIABLE = "TESTS_TURN_LOCK"  # (not LIT3D_*: tests check that a fit leaves none of those behind)


def share_turns() -> bool:
    """Name the file whose lock is the turn, once, in the first pytest process (xdist's controller), whose workers and
    the ranks they start inherit it; whether this process named it (and so removes it at the end: `end_turns`)."""
    if LOCK_VARIABLE in os.environ:
        return False
    os.environ[LOCK_VARIABLE] = str(Path(tempfile.gettempdir()) / f"lit3d-tests-turn-{os.getpid()}.lock")
    return True


def end_turns() -> None:
    Path(os.environ.pop(LOCK_VARIABLE)).unlink(missing_ok=True)


@contextmanager
def turn(holder: str):
    """Hold the machine's turn (wait for it) while several ranks run ``holder`` (a test's id, a job's name); released,
    the holder waits a moment so that a worker waiting for it gets it before the holder's next job asks again
    (`flock` promises no order)."""
    path = os.environ.get(LOCK_VARIABLE)
    if path is None:  # outside the suite (a helper run by hand): nothing to share
        yield
        return
    asked = time.perf_counter()
    with open(path, "a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        got = time.perf_counter()
        try:
            yield
        finally:
            file.write(f"{holder}\t{got - asked:.2f}\t{time.perf_counter() - got:.2f}\t{time.time():.2f}\n")
            file.flush()
            fcntl.flock(file, fcntl.LOCK_UN)
    time.sleep(0.05)


def held() -> list[tuple[str, float, float, float]]:
    """What held the turn so far: (holder, seconds waited, seconds held, when it let go: `time.time`), in order."""
    lines = Path(os.environ[LOCK_VARIABLE]).read_text().splitlines()
    return [(holder, float(waited), float(seconds), float(ended))
            for holder, waited, seconds, ended in (line.split("\t") for line in lines)]  # fmt: skip


@contextmanager
def ranks_turn(holder: str):
    """Inside spawned ranks, around one job (``holder``): rank 0 holds the turn and the others wait for it at a
    barrier (a process group that a job ends is not waited on)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    with turn(holder) if dist.get_rank() == 0 else nullcontext():
        dist.barrier()
        yield
        if dist.is_initialized():
            dist.barrier()
