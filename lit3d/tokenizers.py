"""Tokenizers: raw UTF-8 bytes (no files needed) or a local HuggingFace ``tokenizer.json``."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None
    fingerprint: str  # identifies the tokenization, for the dataset cache

    def encode_batch(self, texts: list[str]) -> list[Sequence[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Each UTF-8 byte is a token: 256 ids, nothing to download or train."""

    vocab_size = 256
    eos_id = None
    fingerprint = "byte"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local HuggingFace ``tokenizers`` file (``tokenizer.json``, or a folder holding one)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
        self._tokenizer = _Tokenizer.from_file(str(path))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = next(
            (
                self._tokenizer.token_to_id(t)
                for t in ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")
                if self._tokenizer.token_to_id(t) is not None
            ),
            None,
        )
        self.fingerprint = "hf-" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [enc.ids for enc in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)


def load_tokenizer(name: str) -> Tokenizer:
    """``"byte"``, or the path of a ``tokenizer.json`` (or of a folder that holds one)."""
    if name == "byte":
        return ByteTokenizer()
    if Path(name).exists():
        return HFTokenizer(name)
    if "/" in name or name.endswith(".json"):
        raise FileNotFoundError(f"tokenizer file {name!r} does not exist")
    raise ValueError(f"unknown tokenizer {name!r}: use 'byte' or the path of a tokenizer.json")
