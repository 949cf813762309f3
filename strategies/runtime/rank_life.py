"""`RankLife`: the threads a rank starts for a fit and stops at its teardown, so that none outlives it.

- the watch on the launcher (`lit3d.strategies.runtime.launchers.LauncherWatch`): a rank our launcher started exits if
  the
  launcher dies;
- the `Watchdog` of a multi-rank run: a rank that stops making progress says where it waits;
- with replica groups, torchft's manager (its heartbeats to the lighthouse: stopped, the group is dropped at once);

NOTE: the process group stays, as under Lightning's own strategies: a script's ``trainer.fit`` and then
``trainer.test`` (or a second fit) run on the same group, and its store keeps its port (one that a new group would
try to bind again while the old socket is still open). It ends when the process exits (`end_process_group_at_exit`):
left to the interpreter's teardown, its backend's threads can be destroyed still running, which aborts the process
("terminate called without an active exception") after a fit that succeeded.
"""

from __future__ import annotations

import atexit
import functools
from typing import Any

from lit3d.strategies.runtime.launchers import LauncherWatch
from lit3d.strategies.runtime.watchdog import Watchdog


class RankLife:
    def __init__(self) -> None:
        self.launcher_watch = LauncherWatch()
        self.watchdog: Watchdog | None = None
        self.replica_groups: Any = None  # `lit3d.strategies.runtime.replica_groups.ReplicaGroups`, joined in setup

    def before_process_group(self) -> None:
        self.launcher_watch.start()

    def after_process_group(self, rank: int, world_size: int, timeout_s: float) -> None:
        end_process_group_at_exit()
        if world_size > 1:  # only ranks that have peers can wait for one
            self.watchdog = Watchdog(rank, timeout_s)
            self.watchdog.start()

    def beat(self, doing: str) -> None:
        """Progress: the watchdog's clock restarts, and it would report ``doing`` as the last thing started."""
        if self.watchdog is not None:
            self.watchdog.beat(doing)

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        self.launcher_watch.stop()
        if self.replica_groups is not None:
            self.replica_groups.stop()
            self.replica_groups = None


@functools.cache  # once per process
def end_process_group_at_exit() -> None:
    atexit.register(_end_process_group)


def _end_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
