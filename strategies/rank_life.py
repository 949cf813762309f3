"""`RankLife`: what a rank starts for a fit and stops at its teardown, so that nothing of a fit outlives it.

- the watch on the launcher (`lit3d.strategies.launchers.LauncherWatch`): a rank our launcher started exits if the
  launcher dies;
- the `Watchdog` of a multi-rank run: a rank that stops making progress says where it waits;
- the process group, if this fit started it (one that the caller started stays theirs): two fits in one process
  (a notebook) are two runs.
"""

from __future__ import annotations

import torch.distributed as dist

from lit3d.strategies.launchers import LauncherWatch
from lit3d.strategies.watchdog import Watchdog


class RankLife:
    def __init__(self) -> None:
        self.launcher_watch = LauncherWatch()
        self.watchdog: Watchdog | None = None
        self.owns_process_group = False

    def before_process_group(self) -> None:
        self.launcher_watch.start()
        self.owns_process_group = not dist.is_initialized()

    def after_process_group(self, rank: int, world_size: int, timeout_s: float) -> None:
        if world_size > 1:  # only ranks that have peers can wait for one
            self.watchdog = Watchdog(rank, timeout_s)
            self.watchdog.start()

    def beat(self, doing: str) -> None:
        """Progress: the watchdog's clock restarts, and it would report ``doing`` as the last thing started."""
        if self.watchdog is not None:
            self.watchdog.beat(doing)

    def stop_threads(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        self.launcher_watch.stop()

    def end_process_group(self) -> bool:
        """Destroy the process group if this fit started it; whether it did."""
        if not (self.owns_process_group and dist.is_initialized()):
            return False
        dist.destroy_process_group()
        self.owns_process_group = False
        return True
