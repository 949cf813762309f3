"""Data: text corpora (`TextDataModule`) and chats (`ChatDataModule`), their sources, tokenizers and batches.

NOTE: the two data modules load on first use (PEP 562), so that the torch-free parts here (sources, tokenizers'
names) stay cheap to import for `lit3d --help` and `lit3d plan`. lit3d 0.3's ``lit3d.data`` was the module that
`lit3d.data.text` is now; its other names (``default_corpus``, ``mixture_weights``) are answered here too, with a
DeprecationWarning, until `lit3d.moved.REMOVED_IN`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lit3d import moved

if TYPE_CHECKING:
    from lit3d.data.chat import ChatDataModule
    from lit3d.data.text import TextDataModule

__all__ = ["ChatDataModule", "TextDataModule"]
_HOMES = {"TextDataModule": "lit3d.data.text", "ChatDataModule": "lit3d.data.chat"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        return moved.old_name(__name__, name)
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
