"""Pre-tokenized corpora: ``lit3d prepare`` writes token shards once; training reads them memory-mapped.

A prepared folder holds ``index.json`` and shards ``tokens-00000.bin``, ... of raw little-endian token ids
(``uint16`` when the vocabulary fits, else ``uint32``): every document, with its BOS and EOS, one after the other,
in the source's order. Training cuts the stream into ``seq_len + 1`` blocks on the fly; a rank maps the shards
into memory and reads only the blocks its batches hold, so its memory does not grow with the corpus.

NOTE: raw memory-mapped shards with a small index (as Megatron's indexed datasets and nanoGPT's ``.bin`` files),
not litdata's format: any block is one or two slices away, which the layout-invariant global-batch sampler needs
(it draws blocks by index), and nothing beyond numpy is needed to read them.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lit3d.data.tokenizers import tokenize_documents
from lit3d.outputs import check_output, make_folder

INDEX = "index.json"
FORMAT = "lit3d-tokens"


def is_prepared(path: str | Path) -> bool:
    index = Path(path) / INDEX
    return index.is_file() and json.loads(index.read_text()).get("format") == FORMAT


def prepared_output(output: str | Path, overwrite: bool = False, make: bool = False) -> Path:
    """The folder `write` writes, by lit3d's rule for outputs (`lit3d.outputs`): a new or empty one; one that holds
    anything only with ``overwrite``, which (with ``make``) empties it. NOTE: a corpus prepared before is not replaced
    unasked either: tokenizing one can take hours."""
    rule = make_folder if make else check_output
    return rule(output, "prepared corpus", lambda path: False, ("*",), overwrite)


def write(
    documents: Any,
    tokenizer: Any,
    tokenizer_name: str,
    output: str | Path,
    num_proc: int = 2,
    shard_tokens: int = 2**27,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize ``documents`` (a `datasets.Dataset` with a ``text`` column) with ``num_proc`` processes and write
    the shards and the index to ``output`` (`prepared_output`); returns the index."""
    import datasets
    from tqdm.auto import tqdm

    output = prepared_output(output, overwrite, make=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
    tokens = documents.map(
        tokenize_documents,
        batched=True,
        remove_columns=documents.column_names,
        features=features,
        fn_kwargs={"tokenizer": tokenizer},
        num_proc=num_proc if num_proc > 1 else None,
        desc=f"tokenizing ({num_proc} processes)",
    )
    shards: list[dict[str, Any]] = []
    shard = None
    with tqdm(total=len(tokens), desc="writing shards", unit="doc") as bar:
        for batch in tokens.with_format("numpy").iter(batch_size=1000):
            stream = np.concatenate(batch["input_ids"]).astype(dtype) if len(batch["input_ids"]) else None
            while stream is not None and len(stream):
                if shard is None or shards[-1]["tokens"] >= shard_tokens:
                    if shard is not None:
                        shard.close()
                    shards.append({"file": f"tokens-{len(shards):05d}.bin", "tokens": 0})
                    shard = open(output / shards[-1]["file"], "wb")
                room = shard_tokens - shards[-1]["tokens"]
                stream[:room].tofile(shard)
                shards[-1]["tokens"] += len(stream[:room])
                stream = stream[room:]
            bar.update(len(batch["input_ids"]))
    if shard is not None:
        shard.close()
    index = {
        "format": FORMAT,
        "version": 1,
        "dtype": np.dtype(dtype).name,
        "tokenizer": tokenizer_name,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "documents": len(tokens),
        "tokens": sum(s["tokens"] for s in shards),
        "shards": shards,
    }
    (output / INDEX).write_text(json.dumps(index, indent=1))
    return index


def read_index(folder: str | Path, tokenizer: Any) -> dict[str, Any]:
    """A prepared folder's index, refused if another tokenizer than ``tokenizer`` wrote its tokens."""
    index = json.loads((Path(folder) / INDEX).read_text())
    if index["tokenizer_fingerprint"] != tokenizer.fingerprint:
        raise ValueError(
            f"{str(folder)!r} was tokenized with tokenizer={index['tokenizer']!r}, which is not this data "
            "module's tokenizer; give the same tokenizer, or prepare the corpus again"
        )
    return index


class PreparedBlocks(torch.utils.data.Dataset):
    """The ``block``-token blocks of a prepared folder's stream, read from its memory-mapped shards."""

    def __init__(self, folder: str | Path, block: int, tokenizer: Any) -> None:
        self.folder, self.block = Path(folder), block
        index = read_index(folder, tokenizer)
        self.files, self.dtype = [self.folder / s["file"] for s in index["shards"]], index["dtype"]
        self.shards = self._map()
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        if self.starts[-1] != index["tokens"]:
            raise ValueError(
                f"{str(folder)!r} is incomplete: its shards hold {self.starts[-1]} of {index['tokens']} tokens"
            )

    def _map(self) -> list[np.memmap]:
        shards = [np.memmap(file, dtype=self.dtype, mode="r") for file in self.files]
        for shard in shards:
            # NOTE: blocks are read in a shuffled order, so reading ahead of each one only wastes I/O. The pages a
            # read maps stay page cache (resident as "file" memory, shared and reclaimed under pressure); the
            # process's own memory does not grow with the corpus (benchmarks/prepare.py measures both).
            if hasattr(mmap, "MADV_RANDOM"):
                shard._mmap.madvise(mmap.MADV_RANDOM)
        return shards

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers map the shards again rather than copy them
        return {**self.__dict__, "shards": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.shards = self._map()

    def __len__(self) -> int:
        return int(self.starts[-1]) // self.block

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start, end, parts = i * self.block, (i + 1) * self.block, []
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < end:
            take = min(end, int(self.starts[shard + 1])) - start
            offset = start - int(self.starts[shard])
            parts.append(self.shards[shard][offset : offset + take])
            start, shard = start + take, shard + 1
        return {"input_ids": torch.from_numpy(np.concatenate(parts).astype(np.int64))}


def throughput(index: dict[str, Any], text_bytes: int, seconds: float, num_proc: int) -> str:
    return (
        f"prepared {index['documents']:,} documents, {index['tokens']:,} tokens in {len(index['shards'])} shard(s) "
        f"from {text_bytes / 1e6:.1f} MB of text in {seconds:.1f} s: {text_bytes / 1e6 / seconds:.1f} MB/s "
        f"with {num_proc} process(es)"
    )
