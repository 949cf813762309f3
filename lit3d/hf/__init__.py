"""HuggingFace in and out: folders (`folders.py`), their config (`config.py`) and experts (`experts.py`), PEFT adapters
(`adapters.py`), the weights a run starts from (`pretrained.py`).

NOTE: lit3d 0.3's ``lit3d.hf`` was the module that `lit3d.hf.folders` is now; its names (``from lit3d.hf import
read_folder``) are answered here, with a DeprecationWarning, until `lit3d.moved.REMOVED_IN`.
"""

from __future__ import annotations

from typing import Any

from lit3d import moved


def __getattr__(name: str) -> Any:
    return moved.old_name(__name__, name)
