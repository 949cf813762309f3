"""Preemption and time limits: stop every rank at the same step, save, and exit with the code a scheduler requeues.

A scheduler ends a job with SIGTERM (SLURM at the time limit or on preemption; with ``--signal=USR1@90`` it warns
with SIGUSR1 first). The signal may reach any process: the launcher (rank 0) or any rank. Each rank only notes it;
at the end of every optimizer step the ranks combine their notes (an all-reduce over a gloo group of its own,
started at one step's end and read at the next, so no step waits for it). The first step at which any rank has
one is the step every rank stops after. Then:

- the loggers get that step's metrics and write out what they hold (a CSVLogger's ``metrics.csv``), so the last
  step shown is the last step logged;
- every rank saves a checkpoint into the run's checkpoint folder (``preempted-step=N.ckpt`` beside the
  `ModelCheckpoint` ones), where ``--ckpt_path last`` finds it, and waits until it is written, also a background
  save already under way (a signal during a save waits for the save);
- rank 0 links it as ``last-preempted.ckpt`` in that folder: Lightning's own ``fit(ckpt_path="last")`` takes the
  newest ``last*.ckpt`` of the run's `ModelCheckpoint` folders, whatever their ``save_last``;
- under SLURM with Lightning's ``SLURMEnvironment(auto_requeue=True)``, rank 0 requeues the job (``scontrol
  requeue``);
- every rank exits with ``128 + signal`` (143 for SIGTERM, 138 for SIGUSR1): non-zero, so nothing takes the job for
  a finished run, and the code of a process ended by that signal, which ``RequeueExit`` in slurm.conf can name.

The exit is raised right after the save, in the step's end: Lightning does not finish the epoch, so no
`ModelCheckpoint` writes a newer checkpoint (by epochs, or ``last.ckpt``) whose loops count the epoch as done, which
a resume would take and start the next epoch's shuffle from. Whatever its settings, "last" is where the run stopped.

A second signal to a process ends it at once (with the same code).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit3d.models.loop import ends_optimizer_step

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """Ends a rank after a preemption checkpoint, with ``128 + signal`` as its exit code."""


class StopOnSignal(Callback):
    """The preemption protocol above, as a callback the strategy adds to every fit."""

    def __init__(self) -> None:
        self.received: int | None = None  # the signal this process received
        self.stop_signal: int | None = None  # the signal every rank agreed to stop on
        self._pending: tuple[Any, torch.Tensor] | None = None  # a started all-reduce of the notes and its tensor
        self._group: Any = None
        self._previous: dict[int, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.received = self.stop_signal = self._pending = None
        if dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        if threading.current_thread() is not threading.main_thread():
            # NOTE: Python delivers signals to the main thread only, and refuses handlers installed elsewhere; a fit
            # run from a thread (a notebook's worker, a server) keeps its process's handlers, and still stops with
            # every rank when another rank was signalled (the agreement below is the same).
            log.info("fit runs outside the main thread: SIGTERM/SIGUSR1 handlers are left to the main thread")
            return
        for number in SIGNALS:
            self._previous[number] = signal.signal(number, self._note)

    def _note(self, number: int, frame: Any) -> None:
        if self.received is not None:  # the second signal: end now
            os._exit(128 + number)
        self.received = number
        rank = dist.get_rank() if dist.is_initialized() else 0
        log.warning(f"rank {rank} received {signal.Signals(number).name}: every rank stops after an agreed step")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if not ends_optimizer_step(trainer) or self.stop_signal is not None:
            return
        agreed = self._agree()
        if agreed:
            self.stop_signal = agreed
            self._save_and_stop(trainer)

    def _agree(self) -> int:
        """The signal any rank noted by the previous step's end (0: none); starts the next step's combining."""
        agreed = 0
        if self._pending is not None:
            work, notes = self._pending
            work.wait()
            agreed = int(notes.item())
        mine = torch.tensor([float(self.received or 0)])
        if self._group is None:  # one process: nothing to combine
            self._pending = None
            return agreed or int(mine.item())
        self._pending = (dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self._group, async_op=True), mine)
        return agreed

    def _save_and_stop(self, trainer: L.Trainer) -> None:
        folder = _checkpoint_folder(trainer)
        path = folder / f"preempted-step={trainer.global_step}.ckpt"
        name = signal.Signals(self.stop_signal).name
        if trainer.is_global_zero:
            log.warning(f"{name}: every rank stops after step {trainer.global_step}; saving {str(path)!r}")
        _flush_loggers(trainer)
        trainer.save_checkpoint(path)
        checkpoints = getattr(trainer.strategy, "checkpoints", None)  # Parallel3DStrategy's, maybe in the background
        if checkpoints is not None:
            checkpoints.wait()
        if trainer.is_global_zero:
            _link_as_last(trainer, path)
            _requeue_under_slurm(trainer)
        # NOTE: no rank exits (128 + signal) before rank 0 has requeued: `srun --kill-on-bad-exit` ends every task
        # as soon as one exits non-zero.
        trainer.strategy.barrier("lit3d-preempted")
        self._stop_listening(wait=True)
        # NOTE: not `trainer.should_stop`: Lightning would then end the epoch, and a ModelCheckpoint would save after
        # this checkpoint one that counts the epoch as done (see the module's docstring).
        raise Preempted(128 + self.stop_signal)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_listening(wait=True)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # NOTE: after a failure a peer may never finish the combining in flight (it died): dropped, not awaited.
        self._stop_listening(wait=False)

    def _stop_listening(self, wait: bool) -> None:
        """Give the process its signal handlers back, and wait for (or drop) the combining in flight."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}
        if self._pending is not None and wait:
            self._pending[0].wait()
        self._pending = None


def _flush_loggers(trainer: L.Trainer) -> None:
    """This step's metrics to the loggers, and every logger's records written out (a CSVLogger's ``metrics.csv``).

    NOTE: Lightning hands a step's metrics to the loggers only after ``on_train_batch_end``, which the preemption exit
    never returns from; like Lightning at a step where training stops, the last step is logged whatever
    ``log_every_n_steps`` (unless logging is off)."""
    connector = trainer._logger_connector
    if trainer.log_every_n_steps > 0:
        connector.log_metrics(connector.metrics["log"])
    for logger in trainer.loggers:
        logger.save()


def _checkpoint_folder(trainer: L.Trainer) -> Path:
    """The run's checkpoint folder: the first `ModelCheckpoint`'s, else ``<default_root_dir>/checkpoints``."""
    callback = _first_model_checkpoint(trainer)
    return Path(callback.dirpath) if callback is not None else Path(trainer.default_root_dir) / "checkpoints"


def _first_model_checkpoint(trainer: L.Trainer) -> ModelCheckpoint | None:
    return next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath), None)


def _link_as_last(trainer: L.Trainer, path: Path) -> None:
    """Rank 0: ``last-preempted.ckpt`` -> ``path``, beside it, where Lightning's ``ckpt_path="last"`` looks (the
    newest file or folder named ``last*.ckpt`` in each `ModelCheckpoint`'s folder)."""
    callback = _first_model_checkpoint(trainer)
    if callback is None:
        return  # no ModelCheckpoint: Lightning's "last" looks nowhere
    link = path.with_name(f"{callback.CHECKPOINT_NAME_LAST}-preempted{callback.FILE_EXTENSION}")
    try:
        link.unlink(missing_ok=True)  # an earlier preemption's
        link.symlink_to(path.name)  # NOTE: relative, so the folder can be moved
    except OSError as error:
        log.warning(f"could not link {str(link)!r} to {path.name!r} ({error}): Lightning's ckpt_path='last' misses it")


def _requeue_under_slurm(trainer: L.Trainer) -> None:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    environment = getattr(trainer.strategy, "cluster_environment", None)
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and job:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        log.warning(f"scontrol requeue {job}: {'done' if result.returncode == 0 else result.stderr.strip()}")
