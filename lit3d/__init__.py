"""lit3d: 3D-parallel (data x tensor x pipeline) training of Llama-style GPTs with PyTorch Lightning."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lit3d import moved

if TYPE_CHECKING:
    from lit3d.models.config import GPTConfig
    from lit3d.models.gpt import GPT
    from lit3d.models.lora import LoRA
    from lit3d.strategies import Parallel3DStrategy

__all__ = ["GPT", "GPTConfig", "LoRA", "Parallel3DStrategy"]
__version__ = "0.4.0"  # the one place: pyproject.toml reads it, `lit3d --version` prints it

# NOTE: the names load on first use (PEP 562): `lit3d --help` and `lit3d plan` import `lit3d.*` modules that need
# neither Lightning nor the model, and importing this package must not pull them in.
_HOMES = {
    "GPT": "lit3d.models.gpt",
    "GPTConfig": "lit3d.models.config",
    "LoRA": "lit3d.models.lora",
    "Parallel3DStrategy": "lit3d.strategies",
}


moved.install()  # the modules' 0.3 names (`lit3d.gpt`, ...) lead to their folders


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'lit3d' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
