"""Tokenizers: raw UTF-8 bytes (no files needed) or a local HuggingFace ``tokenizer.json``."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None  # put before every document (the data module appends `eos_id` after it)
    eos_id: int | None
    fingerprint: str  # identifies the tokenization, for the dataset cache

    def encode_batch(self, texts: list[str]) -> list[Sequence[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Each UTF-8 byte is a token: 256 ids, nothing to download or train."""

    vocab_size = 256
    bos_id = None
    eos_id = None
    fingerprint = "byte"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) for text in texts]

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; an id past the bytes (a model with a larger vocabulary) reads as U+FFFD, as a byte that
        is not UTF-8 does."""
        return b"".join(bytes([i]) if i < 256 else "\ufffd".encode() for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local HuggingFace ``tokenizers`` file (``tokenizer.json``, or a folder holding one).

    Every document is encoded as the tokenizer defines it: its BOS first (the ``bos_token`` of a
    ``tokenizer_config.json`` beside it, or what its post-processor adds), its EOS last (``eos_token``, or a
    well-known end-of-text token), so that packed documents stay apart.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
        self._tokenizer = _Tokenizer.from_file(str(path))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        named = _special_tokens(path.with_name("tokenizer_config.json"))
        added = self._tokenizer.encode("", add_special_tokens=True).ids  # what the post-processor puts around text
        bos = self._id(named.get("bos_token"))
        self.bos_id = bos if bos is not None and named.get("add_bos_token", True) else (added[0] if added else None)
        self.eos_id = self._id(named.get("eos_token"))
        if self.eos_id is None:
            self.eos_id = next(
                (self._id(t) for t in ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>") if self._id(t) is not None),
                None,
            )
        self.fingerprint = "hf-" + hashlib.sha256(path.read_bytes()).hexdigest()[:16] + f"-{self.bos_id}"

    def _id(self, token: str | None) -> int | None:
        return self._tokenizer.token_to_id(token) if token else None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        bos = [self.bos_id] if self.bos_id is not None else []
        return [bos + enc.ids for enc in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)


def _special_tokens(config: Path) -> dict:
    """``bos_token``, ``eos_token`` (names) and ``add_bos_token`` of a ``tokenizer_config.json``, if there is one."""
    import json

    if not config.is_file():
        return {}
    settings = json.loads(config.read_text())
    named = {key: settings.get(key) for key in ("bos_token", "eos_token", "add_bos_token") if key in settings}
    for key in ("bos_token", "eos_token"):  # transformers writes AddedToken dicts too
        if isinstance(named.get(key), dict):
            named[key] = named[key].get("content")
    return named


def load_tokenizer(name: str) -> Tokenizer:
    """``"byte"``, or the path of a ``tokenizer.json`` (or of a folder that holds one)."""
    if name == "byte":
        return ByteTokenizer()
    if Path(name).exists():
        return HFTokenizer(name)
    if "/" in name or name.endswith(".json"):
        raise FileNotFoundError(f"tokenizer file {name!r} does not exist")
    raise ValueError(f"unknown tokenizer {name!r}: use 'byte' or the path of a tokenizer.json")


def tokenize_documents(batch: dict[str, list], tokenizer: Tokenizer) -> dict[str, list]:
    """A batch of documents (``{"text": [...]}``) as token ids, each with the EOS its tokenizer defines (and the BOS,
    from `Tokenizer.encode_batch`); the function `datasets.map`, `lit3d prepare` and streaming tokenize with."""
    ids = tokenizer.encode_batch(batch["text"])
    if tokenizer.eos_id is not None:
        ids = [np.append(doc, tokenizer.eos_id) for doc in ids]
    return {"input_ids": ids}


# What transformers reads from a tokenizer folder besides ``tokenizer.json``: its settings and special tokens, the chat
# templates (transformers 5 keeps the template in ``chat_template.jinja``, named ones in a folder) and a slow
# tokenizer's vocabulary.
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)


def export_tokenizer(name: str | None, folder: Path, max_seq_len: int) -> str:
    """Write the tokenizer a run trained with (``"byte"`` or a ``tokenizer.json``, with every tokenizer file beside
    it: `TOKENIZER_FILES`) into an exported model folder, so ``transformers.AutoTokenizer.from_pretrained(folder)``
    loads it, chat template included; returns one line on what was written, or why nothing was."""
    import json
    import shutil

    if name is None:
        return "tokenizer: not written (the checkpoint does not say which tokenizer its run used)"
    settings: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_seq_len}
    if name == "byte":
        (folder / "tokenizer.json").write_text(_byte_level_json())
        (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "clean_up_tokenization_spaces": False}))
        return "tokenizer: lit3d's byte tokenizer (256 ids, one per UTF-8 byte; no BOS/EOS) as tokenizer.json"
    source = Path(name) / "tokenizer.json" if Path(name).is_dir() else Path(name)
    if not source.is_file():
        return f"tokenizer: not written ({str(source)!r}, the run's tokenizer, is gone)"
    shutil.copyfile(source, folder / "tokenizer.json")
    beside = [source.with_name(n) for n in TOKENIZER_FILES if source.with_name(n).exists()]
    for path in beside:
        if path.is_dir():
            shutil.copytree(path, folder / path.name, dirs_exist_ok=True)
        else:
            shutil.copyfile(path, folder / path.name)
    if not source.with_name("tokenizer_config.json").is_file():
        # NOTE: without one, transformers picks a tokenizer class from the model type
        tokenizer = HFTokenizer(source)
        named = {
            key: tokenizer._tokenizer.id_to_token(i)
            for key, i in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id))
            if i is not None
        }
        (folder / "tokenizer_config.json").write_text(json.dumps({**settings, **named}))
    with_files = f" with {', '.join(path.name for path in beside)}" if beside else ""
    return f"tokenizer: {str(source)!r}, the run's own{with_files}"


def _byte_level_json() -> str:
    """`ByteTokenizer` as a HuggingFace ``tokenizer.json``: byte-level pre-tokenization (GPT-2's byte-to-character
    table) and a vocabulary of the 256 byte characters, each id the byte's value, with no merges."""
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    unprintable = iter(range(256, 512))  # GPT-2 moves the other bytes past 255, in byte order
    character = {b: chr(b if b in printable else next(unprintable)) for b in range(256)}
    tokenizer = _Tokenizer(models.BPE(vocab={character[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str()
