"""Every error type lit3d raises that a user may catch, importable without torch (the ``lit3d`` command names them
before it imports anything heavy): a configuration refused before anything runs, a checkpoint file that holds code,
and one that is broken."""

from __future__ import annotations

import pickle


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asked to load something other than data."""


class CorruptCheckpointError(ValueError):
    """A checkpoint file that is empty, truncated or damaged: no loader, safe or not, can read it."""


class ConfigurationError(ValueError, RuntimeError):
    """A configuration refused before any process group exists: in the launching process before any rank starts, or
    first thing in each rank that torchrun or SLURM started. A `ValueError`, and a `RuntimeError` as Lightning's
    `ModelParallelStrategy` raises for mesh sizes, so either ``except`` catches it. Nothing has run, so nothing
    failed: the ``lit3d`` command prints it as one line, and the watchdog does not report it as a failed rank."""
