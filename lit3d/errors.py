"""What reading a checkpoint can refuse, importable without torch (the ``lit3d`` command names them before it
imports anything heavy): a file that holds code, and a file that is broken."""

from __future__ import annotations

import pickle


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asked to load something other than data."""


class CorruptCheckpointError(ValueError):
    """A checkpoint file that is empty, truncated or damaged: no loader, safe or not, can read it."""
