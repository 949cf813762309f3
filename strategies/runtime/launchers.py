"""Starting the ranks, and ending them when something goes wrong.

Torchrun and SLURM start every rank themselves; otherwise one of these launchers does, after checking the
configuration in the launching process, so a bad layout fails once, before any process group exists:

- `CheckingLauncher`: Lightning's script launcher (re-runs the command line once per local rank);
- `ForkLauncher`: forks the ranks from the current process, as Lightning's ``ddp_notebook`` does (Jupyter).

A rank our launcher started watches it (`LauncherWatch`): if rank 0's process dies, the rank exits
instead of waiting in a collective. Lightning already ends every rank when a child fails; this covers the other
direction.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit3d.checkpoint.folder import check_ckpt_path


class CheckedStrategy(Protocol):
    """What a launcher reads of its strategy (`lit3d.strategies.Parallel3DStrategy`): Lightning's launch sizes and the
    configuration check it runs before any rank starts."""

    cluster_environment: Any
    num_processes: int
    num_nodes: int
    local_rank: int

    def check_configuration(self, trainer: Trainer | None, datamodule: Any) -> None: ...


log = logging.getLogger(__name__)
LAUNCHER_PID = "LIT3D_LAUNCHER_PID"


class _ChecksFirst:
    """Check the configuration before any rank starts, then let the ranks watch this process."""

    _strategy: CheckedStrategy

    def launch(self, function: Any, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        # `Trainer.fit` (validate, ...) hands its datamodule to the launcher; it reaches the trainer in the ranks only.
        datamodule = next((arg for arg in args if isinstance(arg, LightningDataModule)), None)
        self._strategy.check_configuration(trainer, datamodule)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        resuming = self._strategy.lightning_module if fitting else None  # (its optimizer must be the checkpoint's)
        for ckpt_path in (arg for arg in args if isinstance(arg, str | Path)):  # the only path among the arguments
            check_ckpt_path(ckpt_path, resuming)
        earlier = os.environ.get(LAUNCHER_PID)
        os.environ[LAUNCHER_PID] = str(os.getpid())  # read by the ranks this starts (`LauncherWatch`)
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:  # nothing of this launch outlives it (a notebook's next fit starts clean)
            os.environ.pop(LAUNCHER_PID) if earlier is None else os.environ.__setitem__(LAUNCHER_PID, earlier)


class CheckingLauncher(_ChecksFirst, _SubprocessScriptLauncher):
    """Lightning's script launcher, but the configuration is checked before any child process starts."""

    def __init__(self, strategy: CheckedStrategy) -> None:
        super().__init__(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
        self._strategy = strategy


class ForkLauncher(_ChecksFirst, _MultiProcessingLauncher):
    """Forks the ranks from the current process, as Lightning's ``ddp_notebook`` does: works in Jupyter.

    The configuration is checked before forking. Metrics (``trainer.callback_metrics``) and the best checkpoint
    path come back to the notebook; the weights stay sharded in the ranks, so save a checkpoint to keep them.
    """

    def __init__(self, strategy: CheckedStrategy) -> None:
        super().__init__(strategy, start_method="fork")

    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> _WorkerOutput | None:
        if self._strategy.local_rank != 0:
            return None
        best = getattr(trainer.checkpoint_callback, "best_model_path", None)
        return _WorkerOutput(best, None, trainer.state, results, self.get_extra_results(trainer))


def agree_on_seed() -> None:
    """Take rank 0's seed on every rank if they were seeded apart (no ``seed_everything``): the weights come from
    the seed (`Transformer.reset_parameters`), and replicas that start apart would stay apart."""
    seeds: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(seeds, torch.initial_seed())
    if len(set(seeds)) > 1:
        rank_zero_warn(
            f"the ranks were seeded differently ({len(set(seeds))} seeds; call `seed_everything`): "
            f"every rank now uses rank 0's seed {seeds[0]}, so all start from the same weights"
        )
        torch.manual_seed(seeds[0])


class LauncherWatch:
    """In a process our launcher started: exit if the launcher (rank 0) dies, rather than wait in a collective.
    `stop` ends the watch (the strategy's teardown): no thread of a fit outlives it."""

    def __init__(self) -> None:
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        launcher = os.environ.get(LAUNCHER_PID)
        if self._thread is not None or launcher is None:
            return
        if int(launcher) == os.getpid() or os.getppid() != int(launcher):
            return
        self._stopped.clear()  # (a watch stopped at an earlier stage's teardown watches again)
        self._thread = threading.Thread(target=self._watch, args=(int(launcher),), name="lit3d-launcher-watch")
        self._thread.daemon = True
        self._thread.start()

    def _watch(self, launcher: int) -> None:
        while os.getppid() == launcher:
            if self._stopped.wait(1.0):
                return
        log.error(f"rank 0 (pid {launcher}) has exited; ending this rank (pid {os.getpid()})")
        os._exit(1)

    def stop(self) -> None:
        if self._thread is not None:
            self._stopped.set()
            self._thread.join()
            self._thread = None
