"""Run many jobs on one group of spawned CPU ranks (gloo), one after another, and survive the ones that fail.

Starting processes is the slow part on a small machine, so one spawn of ``world`` ranks runs every job of that world
size over the same process group. A job that raises on a rank (or runs past ``job_timeout``) ends the group: it is
reported failed, with the first error any rank wrote, and a fresh group runs the jobs left.

A job is plain data (picklable); ``runner`` (``"module:function"``) runs it on each rank as
``runner(job, job_dir, world)`` and returns what that rank reports (JSON-able).
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

# NOTE: ranks are forked from a server process that has imported torch, Lightning and lit3d once, rather than each
# spawned rank importing them again (about 5 s of one core per rank).
START_METHOD = "forkserver"
PRELOAD = ["torch", "lightning.pytorch", "lit3d.models.gpt", "lit3d.strategies", "lit3d.data.text", "lit3d.data.chat"]


def run_group(
    world: int,
    jobs: dict[str, Any],
    runner: str,
    out_dir: Path,
    job_timeout: float = 600,
    on_result: Callable[[str, dict], None] = lambda name, result: None,
) -> dict[str, dict]:
    """Each of ``jobs`` on ``world`` ranks; per job ``{"ranks": [each rank's report]}`` or ``{"error": "..."}``, also
    handed to ``on_result`` as soon as it is known."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    results: dict[str, dict] = {}
    left = list(jobs)
    while left:
        group_dir = out_dir / f"group{len(results)}"
        context = mp.start_processes(_worker, args=(world, _free_port(), {n: jobs[n] for n in left}, runner,
                                                    str(group_dir)), nprocs=world, start_method=START_METHOD,
                                     join=False)  # fmt: skip
        since, timed_out = time.time(), False
        while True:
            try:
                ended = context.join(timeout=1)
            except ProcessException:  # a rank failed: the others were ended
                ended = True
            while left and _finished(group_dir / left[0], world):  # reported in job order
                name = left.pop(0)
                results[name] = {"ranks": [_read(group_dir / name / f"rank{r}.json") for r in range(world)]}
                on_result(name, results[name])
                since = time.time()
            if ended:
                break
            if time.time() - since > job_timeout:
                _kill(context)
                timed_out = True
                break
        if left:  # the group ended before the next job finished: that job failed
            name = left.pop(0)
            error = f"still running after {job_timeout:.0f} s (a hang?): killed" if timed_out else None
            results[name] = {"error": error or _first_error(group_dir / name, world)}
            on_result(name, results[name])
    return results


def _worker(rank: int, world: int, port: int, jobs: dict[str, Any], runner: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0", HF_DATASETS_DISABLE_PROGRESS_BARS="1")  # fmt: skip
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    log = os.open(Path(out_dir) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1), os.dup2(log, 2)  # each rank's own log: the parent prints one line per job
    module, function = runner.split(":")
    run = getattr(importlib.import_module(module), function)
    # NOTE: one process group for every job (a strategy ends only a group it started itself).
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for name, job in jobs.items():
        job_dir = Path(out_dir) / name
        job_dir.mkdir(parents=True, exist_ok=True)
        try:
            report = run(job, job_dir, world)
            dist.barrier()  # NOTE: every rank done before any starts the next job, whose failure would end this one
        except BaseException as error:  # reported; then this group ends
            (job_dir / f"rank{rank}.error").write_text(_one_line(error) + "\n" + traceback.format_exc())
            os._exit(1)  # NOTE: at once: the other ranks may wait in a collective that will never come
        partial = job_dir / f"rank{rank}.partial"
        partial.write_text(json.dumps(report))
        partial.rename(job_dir / f"rank{rank}.json")  # (whole, or not there yet, when the parent looks)
    dist.barrier()
    dist.destroy_process_group()


def _kill(context: Any) -> None:
    for process in context.processes:
        process.kill()
    try:
        context.join()
    except ProcessException:
        pass


def _one_line(error: BaseException) -> str:
    """``Type: message`` on one line, and where it was raised (the innermost frame of lit3d or the strategies)."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "/lit3d/" in f.filename or "/strategies/" in f.filename] or frames
    where = f" ({Path(ours[-1].filename).name}:{ours[-1].lineno})" if ours else ""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}{where}"


def _finished(job_dir: Path, world: int) -> bool:
    return all((job_dir / f"rank{r}.json").exists() for r in range(world))


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def _first_error(job_dir: Path, world: int) -> str:
    """The error the first failing rank wrote (the others' follow from it), or how the group ended without one."""
    errors = sorted((job_dir.glob("rank*.error")), key=lambda path: path.stat().st_mtime)
    if not errors:
        return "a rank exited without reporting an error (killed, or out of memory)"
    return errors[0].read_text().splitlines()[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
