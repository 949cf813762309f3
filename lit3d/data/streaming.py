"""Streaming: sources too large to cache, read as they are trained on, with layout-invariant batches and exact resume.

The documents come from `datasets`' streaming `IterableDataset`s (nothing is cached), are tokenized one by one and
cut into blocks of ``seq_len + 1`` tokens. A stream has no random access, so the shuffle is local: blocks are read in
windows of about `WINDOW_TOKENS` tokens (whole global batches), each window permuted by a seed of (seed, epoch,
window). Global batch k is the same blocks in every layout because every rank reads the same stream and keeps its
share of each global batch, dealt as `GlobalBatchSampler` deals it.

Resuming needs no replay: every block carries the stream's position after its global batch (each source's
`datasets` state before the document the window starts in, and the tokens of that document already used), the
data module keeps the position of the last batch training consumed (not one the loader prefetched) and checkpoints
it. The stream cycles: when a source runs out, the next epoch starts, so streaming runs are measured in
``max_steps``.

NOTE: every data-parallel rank tokenizes the whole stream and keeps its share; splitting the files by rank would
make global batches depend on the layout. Tokenizing is cheap next to a training step of a model worth 3D
parallelism, and a prepared folder (``lit3d prepare``) avoids it altogether.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from lit3d.data.tokenizers import tokenize_documents

WINDOW_TOKENS = 2**24  # the shuffle window: 64 MiB of int32 tokens


class BlockReader:
    """The blocks of one source's documents, from a position ``{"documents": datasets state or None, "skip": n}``:
    the state before a document and how many of its tokens earlier blocks used."""

    def __init__(self, documents: Any, tokenizer: Any, block: int, position: dict[str, Any] | None = None) -> None:
        self.documents, self.tokenizer, self.block = documents, tokenizer, block
        position = position or {"documents": None, "skip": 0}
        if position["documents"] is not None:
            documents.load_state_dict(position["documents"])
        self.rows, self.skip = iter(documents), position["skip"]
        self.buffer = np.zeros(0, np.int32)
        self.docs: deque[list] = deque()  # [state before, length, tokens used] of the documents in the buffer

    def position(self) -> dict[str, Any]:
        """Where the next block starts."""
        if self.docs:
            state, _, used = self.docs[0]
            return {"documents": state, "skip": used}
        return {"documents": self.documents.state_dict(), "skip": self.skip}

    def next_block(self) -> np.ndarray | None:
        """The next block, or ``None`` when the documents end."""
        while len(self.buffer) < self.block:
            state = self.documents.state_dict()
            row = next(self.rows, None)
            if row is None:
                return None
            (tokens,) = tokenize_documents({"text": [row["text"]]}, self.tokenizer)["input_ids"]
            self.docs.append([state, len(tokens), self.skip])
            self.buffer = np.concatenate([self.buffer, np.asarray(tokens, np.int32)[self.skip :]])
            self.skip = 0
        out, self.buffer, used = self.buffer[: self.block], self.buffer[self.block :], self.block
        while used:
            doc = self.docs[0]
            take = min(used, doc[1] - doc[2])
            doc[2], used = doc[2] + take, used - take
            if doc[2] == doc[1]:
                self.docs.popleft()
        return out


def draw_blocks(readers: list[BlockReader], weights: list[float], rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Up to ``n`` blocks, each from a source drawn by weight; fewer when a source runs out (its blocks never
    repeat, so the shares are the weights)."""
    blocks = []
    for source in rng.choice(len(readers), size=n, p=weights) if len(readers) > 1 else np.zeros(n, int):
        block = readers[source].next_block()
        if block is None:
            break
        blocks.append(block)
    return blocks


class StreamedBlocks(torch.utils.data.IterableDataset):
    """This rank's share of every global batch of a stream, each sample tagged with the stream's position.

    Args:
        open_documents: Opens a source's documents as a `datasets.IterableDataset` with a ``text`` column.
        sources: ``{source: share}``.
        start: Each source's position where an epoch's training blocks start (after the held-out blocks).
        resume: A position a checkpoint recorded (`TextDataModule.state_dict`), or ``None``.
    """

    def __init__(
        self,
        open_documents: Any,
        sources: dict[str, float],
        tokenizer: Any,
        block: int,
        global_batch_size: int,
        replicas: int,
        rank: int,
        seed: int,
        start: list[dict],
        resume: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.open_documents, self.sources, self.tokenizer, self.block = open_documents, sources, tokenizer, block
        self.global_batch_size, self.replicas, self.rank, self.seed = global_batch_size, replicas, rank, seed
        self.start, self.resume = start, resume
        self.window = window_blocks(global_batch_size, block)

    def readers(self, positions: list[dict]) -> list[BlockReader]:
        return [
            BlockReader(self.open_documents(source), self.tokenizer, self.block, position)
            for source, position in zip(self.sources, positions)
        ]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        G, weights = self.global_batch_size, list(self.sources.values())
        here = self.resume or {"epoch": 0, "window": 0, "batch": 0, "sources": self.start}
        while True:  # epochs: the stream cycles
            epoch, window, first, readers = here["epoch"], here["window"], here["batch"], self.readers(here["sources"])
            from_the_start, batches, ended = window == 0 and first == 0, 0, False
            while not ended:
                begins = here["sources"]
                rng = np.random.default_rng([self.seed, epoch, window])
                blocks = draw_blocks(readers, weights, rng, self.window)
                ended = len(blocks) < self.window
                after = {"epoch": epoch, "window": window + 1, "batch": 0, "sources": [r.position() for r in readers]}
                if ended:
                    after = {"epoch": epoch + 1, "window": 0, "batch": 0, "sources": self.start}
                order = rng.permutation(len(blocks) - len(blocks) % G)
                for k in range(first, len(order) // G):
                    here = {"epoch": epoch, "window": window, "batch": k, "sources": begins}
                    last = after if (k + 1) * G == len(order) else {**here, "batch": k + 1}
                    share = order[k * G : (k + 1) * G][self.rank :: self.replicas]
                    tags = json.dumps(here), json.dumps(last)  # once per global batch, not per block
                    for j, i in enumerate(share):
                        tag = tags[j == len(share) - 1]
                        yield {"input_ids": torch.from_numpy(blocks[i].astype(np.int64)), "stream": tag}
                    batches += 1
                here, window, first = after, window + 1, 0
            if from_the_start and not batches:
                raise ValueError(
                    f"the stream holds fewer than one global batch ({G} blocks of {self.block} tokens) after the "
                    "held-out blocks; use more text or a smaller seq_len / global_batch_size"
                )


def window_blocks(global_batch_size: int, block: int) -> int:
    """Blocks per shuffle window: about `WINDOW_TOKENS`, whole global batches, at least one."""
    return global_batch_size * max(1, WINDOW_TOKENS // (global_batch_size * block))


def held_out(
    open_documents: Any,
    sources: dict[str, float],
    tokenizer: Any,
    block: int,
    global_batch_size: int,
    seed: int,
    fractions: tuple[float, float],
) -> tuple[list, list, list[dict]]:
    """The validation and test blocks: the given fractions of the stream's first window, taken from its start; and
    each source's position after them, where training starts."""

    def readers() -> list[BlockReader]:
        return [BlockReader(open_documents(source), tokenizer, block) for source in sources]

    weights, key = list(sources.values()), [seed, 2**31 - 1]
    first = draw_blocks(readers(), weights, np.random.default_rng(key), window_blocks(global_batch_size, block))
    n_val = max(1, round(fractions[0] * len(first)))
    n_test = max(1, round(fractions[1] * len(first))) if fractions[1] else 0
    if len(first) < window_blocks(global_batch_size, block) and len(first) - n_val - n_test < global_batch_size:
        raise ValueError(
            f"the stream packs into {len(first)} blocks of seq_len+1={block} tokens, too few for a global batch of "
            f"{global_batch_size} plus {n_val} validation and {n_test} test blocks; use more text or a smaller "
            "seq_len / global_batch_size"
        )
    again = readers()  # read the held-out blocks once more, to know where they end
    draw_blocks(again, weights, np.random.default_rng(key), n_val + n_test)
    return first[:n_val], first[n_val : n_val + n_test], [r.position() for r in again]
