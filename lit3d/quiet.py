"""What lit3d's commands leave out of Lightning's output: lines that ask nothing of a lit3d user and would bury the ones
that do (the rank map, the plan line, the progress bar, the samples, and every warning about the run itself).

- Lightning's two "💡 Tip:" advertisements (LitLogger, LitModelCheckpoint), printed on every fit;
- torch's deprecation of ``LeafSpec``, which Lightning's own ``_pytree`` still calls, printed once per rank;
- "`weights_only` was not set", which Lightning logs on every save of a full checkpoint (preemption saves included):
  a full checkpoint is what a resumable save is.

Each is dropped by its exact message, so any other warning or log line of the same module still shows.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

# logger name -> the beginnings of the messages dropped from it
DROPPED_LOGS = {
    "lightning.pytorch.utilities.rank_zero": ("💡 Tip:",),  # `rank_zero_info`'s logger (the last one imported)
    "lightning.fabric.utilities.rank_zero": ("💡 Tip:",),
    "lightning.pytorch.trainer.connectors.checkpoint_connector": ("`weights_only` was not set",),
}
DROPPED_WARNINGS = (r"`isinstance\(treespec, LeafSpec\)` is deprecated",)  # FutureWarning, from torch


class DropMessages(logging.Filter):
    """Drops the records whose message starts with one of ``beginnings``."""

    def __init__(self, beginnings: tuple[str, ...]) -> None:
        super().__init__()
        self.beginnings = beginnings

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.beginnings)


def quiet_lightning() -> None:
    """Leave out `DROPPED_LOGS` and `DROPPED_WARNINGS` in this process (each rank runs the command, and this, again)."""
    for message in DROPPED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    for name, beginnings in DROPPED_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(beginnings))


@contextmanager
def lightning_info_silenced() -> Iterator[None]:
    """Lightning's info lines (devices, "`Trainer.fit` stopped") left out inside the block, its warnings kept: for a
    fit that is a means, not the command's subject (`lit3d calibrate`'s timing loop, `lit3d generate`)."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
