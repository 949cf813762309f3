"""Packed sequences: several documents (or chat examples) in one row, kept apart.

A packed row comes with each token's position inside its own document (``positions``): a document starts where the
position is 0. Attention then never crosses a document boundary and rotary positions restart per document, so a
packed row computes what its documents would compute one by one.

What the attention of the next forward sees is this rank's `Documents`, set per batch by the module (`use`), cut to
this rank's tokens by context parallelism (`lit3d.models.runner.ContextShare`) and to one micro-batch's rows by a
pipeline stage (`micro_batch`). A block recomputed in backward sees again what its forward saw (`held`, restored by
`lit3d.strategies.recompute`), wherever the backward runs.

NOTE: held here, per process, instead of passed as an argument: a pipeline stage receives only the previous stage's
hidden state, and a block recomputed in backward (activation checkpointing) runs again without its caller.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Documents:
    """The documents of the rows this rank computes.

    Attributes:
        positions: ``[batch, seq]``: each token's position within its document (rotary).
        segments: ``[batch, seq]``: which document of its row each token belongs to (numbered from 1).
        whole_segments: ``[batch, whole_seq]``: ``segments`` of the whole rows, before context parallelism cut them
            (the ring attention reads the segments of the blocks other ranks hold from it).
    """

    positions: torch.Tensor
    segments: torch.Tensor
    whole_segments: torch.Tensor

    @classmethod
    def of(cls, positions: torch.Tensor) -> Documents:
        segments = torch.cumsum(positions == 0, dim=-1)
        return cls(positions, segments, segments)

    def rows(self, start: int, stop: int) -> Documents:
        return Documents(self.positions[start:stop], self.segments[start:stop], self.whole_segments[start:stop])

    @functools.cached_property
    def causal_mask(self) -> torch.Tensor:
        """`attention_mask` of these tokens among themselves, made once for every layer of a forward."""
        return attention_mask(self.segments, self.segments, causal=True)

    def causal_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """`causal_mask` as the additive bias SDPA makes of a boolean mask (0 where a token attends, -inf elsewhere),
        in ``dtype``, made once for every layer of a forward. NOTE: given the boolean mask, SDPA makes this bias at
        every call, and each layer's backward keeps its own copy: ``[batch, 1, seq, seq]`` per layer."""
        if dtype not in self._biases:
            mask = self.causal_mask
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            self._biases[dtype] = bias.masked_fill_(mask.logical_not(), float("-inf"))
        return self._biases[dtype]

    @functools.cached_property
    def _biases(self) -> dict[torch.dtype, torch.Tensor]:
        return {}


_current: list[Documents | None] = [None]


def use(documents: Documents | None) -> None:
    """The documents of the batch the next forward runs (``None``: every row is one sequence)."""
    _current[0] = documents


def held() -> Documents | None:
    """The documents set for the next forward, unchecked: what a block's recomputation in backward must see again
    (`lit3d.strategies.recompute`)."""
    return _current[0]


def current(batch: int, seq: int) -> Documents | None:
    """The documents of the ``[batch, seq]`` tokens a forward is computing, if the rows are packed."""
    documents = _current[0]
    if documents is not None and tuple(documents.positions.shape) != (batch, seq):
        raise RuntimeError(
            f"packed documents of shape {tuple(documents.positions.shape)} set for a forward over {batch}x{seq} tokens"
        )
    return documents


@contextmanager
def micro_batch(index: int, count: int) -> Iterator[None]:
    """Within it, the documents are micro-batch ``index`` of ``count`` (a pipeline stage's share of the rows)."""
    whole = _current[0]
    if whole is None:
        yield
        return
    rows = whole.positions.shape[0] // count
    _current[0] = whole.rows(index * rows, (index + 1) * rows)
    try:
        yield
    finally:
        _current[0] = whole


def attention_mask(query_segments: torch.Tensor, key_segments: torch.Tensor, causal: bool) -> torch.Tensor:
    """``[batch, 1, q, k]``: which keys each query may attend (its own document's; causally when ``causal``)."""
    allowed = query_segments[:, :, None] == key_segments[:, None, :]
    if causal:
        q, k = query_segments.shape[1], key_segments.shape[1]
        allowed = allowed & torch.ones(q, k, dtype=torch.bool, device=allowed.device).tril()
    return allowed[:, None]


def attended_length(positions: torch.Tensor) -> float:
    """The length of the document a token sits in, averaged over the tokens of ``positions`` ``[batch, seq]``: the
    sequence length that gives whole-sequence attention the FLOPs the documents' masks keep."""
    segments = Documents.of(positions).segments
    offset = segments + segments.shape[1] * torch.arange(segments.shape[0], device=segments.device)[:, None]
    lengths = torch.bincount(offset.flatten())
    return float(lengths[offset.flatten()].float().mean())


def row_positions(starts: np.ndarray) -> np.ndarray:
    """Each token's position within its document, from ``starts`` ``[rows, seq]`` (where a document begins). A row's
    first tokens, the end of a document begun in an earlier row, count as a document of their own."""
    index = np.broadcast_to(np.arange(starts.shape[1]), starts.shape)
    last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return (index - last_start).astype(np.int32)


def document_starts(lengths: list[int]) -> np.ndarray:
    """``True`` where each of the documents of ``lengths``, laid end to end, begins."""
    lengths = [n for n in lengths if n]  # (an empty document starts nowhere)
    starts = np.zeros(int(sum(lengths)), dtype=bool)
    starts[np.cumsum(lengths)[:-1]] = True
    if len(starts):
        starts[0] = True
    return starts
