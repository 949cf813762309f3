"""The settings of how a run starts, waits, saves and plans itself (not how it is split): what no run could use,
named. `lit3d.parallel.Parallelism.check` asks them."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

START_METHODS = ("popen", "fork")


def interactive() -> bool:
    """A notebook or a Python prompt (Lightning's test): script launchers cannot re-run it per rank."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive)


def check_run_settings(p: Any) -> None:
    """``p``'s start method, checkpoint format, timeout and planning settings (a `lit3d.parallel.Parallelism`)."""
    if p.start_method not in (None, *START_METHODS):
        raise ValueError(f"start_method={p.start_method!r} is not one of 'popen', 'fork' (or None: automatic)")
    if p.start_method == "popen" and interactive():
        raise ValueError(
            "start_method='popen' cannot start ranks from a notebook or an interactive session: "
            "use start_method='fork' (or leave it unset), or run a script"
        )
    for name in ("async_checkpoint", "save_distributed_checkpoint", "accumulate_unsharded", "auto_layout"):
        if not isinstance(getattr(p, name), bool):
            raise ValueError(f"{name}={getattr(p, name)!r} must be True or False")
    if p.islands > 1 and not p.save_distributed_checkpoint:
        raise ValueError(
            f"islands={p.islands} keeps each island's own weights in its checkpoint folder; "
            "save_distributed_checkpoint=False (one file of one set of weights) needs islands=1"
        )
    if p.async_checkpoint and not p.save_distributed_checkpoint:
        raise ValueError(
            "async_checkpoint=True writes sharded folders in the background; with save_distributed_checkpoint="
            "False (one consolidated file) use async_checkpoint=False"
        )
    _check_replica_groups(p)
    if not isinstance(p.timeout, timedelta) or p.timeout.total_seconds() <= 0:
        raise ValueError(f"timeout={p.timeout!r} must be a positive datetime.timedelta")
    _check_planning(p)


def _check_replica_groups(p: Any) -> None:
    groups = p.replica_groups
    if groups is None:
        return
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"replica_groups={groups!r} must be a number of groups >= 1 (or None: no fault tolerance)")
    if p.islands > 1:
        raise ValueError(
            f"replica_groups={groups} with islands={p.islands}: each replica group is one DiLoCo island (a job of its "
            "own); set islands=1 and sync_every > 1 for DiLoCo across the groups"
        )
    if p.sync_every > 1 and p.outer_fragments > 1:
        raise ValueError(
            f"replica_groups={groups} with outer_fragments={p.outer_fragments}: streaming DiLoCo across replica "
            "groups is not built (a group joins at the start of a round, when every fragment has met); use "
            "outer_fragments=1"
        )


def _check_planning(p: Any) -> None:
    if p.plan_profile is not None and not Path(p.plan_profile).is_file():
        raise ValueError(f"plan_profile={p.plan_profile!r} is not a file: give what `lit3d calibrate` wrote")
    memory = p.auto_memory_gb
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int | float) or memory <= 0):
        raise ValueError(f"auto_memory_gb={memory!r} must be a positive number of GB (or None: the device's)")
