"""Data: text corpora (`TextDataModule`) and chats (`ChatDataModule`), their sources, tokenizers and batches.

NOTE: the two data modules load on first use (PEP 562), so that the torch-free parts here (sources, tokenizers'
names) stay cheap to import for `lit3d --help` and `lit3d plan`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lit3d.data.chat import ChatDataModule
    from lit3d.data.text import TextDataModule

__all__ = ["ChatDataModule", "TextDataModule"]
_HOMES = {"TextDataModule": "lit3d.data.text", "ChatDataModule": "lit3d.data.chat"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'lit3d.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
