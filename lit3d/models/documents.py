"""Packed sequences: several documents (or chat examples) in one row, kept apart.

A packed row comes with each token's position inside its own document (``positions``): a document starts where the
position is 0. Attention then never crosses a document boundary and rotary positions restart per document, so a
packed row computes what its documents would compute one by one.

A batch's documents reach the attention in its `lit3d.models.batch_context.BatchContext`, which a pipeline splits by
rows and context parallelism cuts to a rank's tokens (`lit3d.models.runner.ContextShare`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class Masks:
    """The masks of one set of documents, made at first use and shared by every layer of a forward.

    NOTE: a plain object: FSDP2 casts each block's inputs by rebuilding the dataclasses (and dicts) among them, and
    hands this on as it is, so every block's copy of the documents keeps one mask (and one bias per dtype)."""

    def __init__(self) -> None:
        self.causal: torch.Tensor | None = None
        self.biases: dict[tuple[torch.dtype, int | None, bool], torch.Tensor] = {}


@dataclass(frozen=True)
class Documents:
    """The documents of the rows this rank computes.

    Attributes:
        positions: ``[batch, seq]``: each token's position within its document (rotary).
        segments: ``[batch, seq]``: which document of its row each token belongs to (numbered from 1).
        whole_segments: ``[batch, whole_seq]``: ``segments`` of the whole rows, before context parallelism cut them
            (the ring attention reads the segments of the blocks other ranks hold from it).
        masks: Their masks, made once for every layer of a forward (`causal_mask`, `causal_bias`).
    """

    positions: torch.Tensor
    segments: torch.Tensor
    whole_segments: torch.Tensor
    masks: Masks = field(default_factory=Masks, compare=False, repr=False)

    @classmethod
    def of(cls, positions: torch.Tensor) -> Documents:
        segments = torch.cumsum(positions == 0, dim=-1)
        return cls(positions, segments, segments)

    # NOTE: eager under `compile` (here and in `causal_bias`): a layer that makes the mask and one that finds it made
    # then run the same graph, as a block recomputed in backward must (it finds made what its forward made).
    @property
    @torch.compiler.disable
    def causal_mask(self) -> torch.Tensor:
        """`attention_mask` of these tokens among themselves, made once for every layer of a forward."""
        if self.masks.causal is None:
            self.masks.causal = attention_mask(self.segments, self.segments, causal=True)
        return self.masks.causal

    @torch.compiler.disable
    def causal_bias(self, dtype: torch.dtype, window: int | None = None, sink: bool = False) -> torch.Tensor:
        """`causal_mask` as the additive bias SDPA makes of a boolean mask (0 where a token attends, -inf elsewhere),
        in ``dtype``, made once for every layer of a forward; with a ``window``, a query sees only the last ``window``
        tokens of its document; with a ``sink``, one more key column of zeros first (`lit3d.models.attention`).
        NOTE: given the boolean mask, SDPA makes this bias at every call, and each layer's backward keeps its own
        copy: ``[batch, 1, seq, seq]`` per layer."""
        biases = self.masks.biases
        if (dtype, window, sink) not in biases:
            mask = self.causal_mask
            if window is not None:
                mask = mask & window_mask(mask.shape[-1], window, mask.device)
            biases[dtype, window, sink] = aligned_bias(mask, dtype, sink)
        return biases[dtype, window, sink]


def attention_mask(query_segments: torch.Tensor, key_segments: torch.Tensor, causal: bool) -> torch.Tensor:
    """``[batch, 1, q, k]``: which keys each query may attend (its own document's; causally when ``causal``)."""
    allowed = query_segments[:, :, None] == key_segments[:, None, :]
    if causal:
        q, k = query_segments.shape[1], key_segments.shape[1]
        allowed = allowed & torch.ones(q, k, dtype=torch.bool, device=allowed.device).tril()
    return allowed[:, None]


def aligned_bias(allowed: torch.Tensor, dtype: torch.dtype, sink: bool = False) -> torch.Tensor:
    """The additive bias of the boolean mask ``allowed`` (``[..., q, k]``), with a sink's column of zeros first, laid
    out with rows of a multiple of 16 elements: a view SDPA's memory-efficient kernel takes as it is (it copies a mask
    of other strides into an aligned one at every call, and keeps that copy for backward). Made as a plain tensor even
    under inference mode (a validation's forward), since training keeps it for backward later."""
    *lead, rows, cols = allowed.shape
    width = -(-(cols + sink) // 16) * 16
    with torch.inference_mode(False), torch.no_grad():
        bias = torch.zeros(*lead, rows, width, dtype=dtype, device=allowed.device)
        bias[..., sink : sink + cols].masked_fill_(allowed.logical_not(), float("-inf"))
    return bias[..., : cols + sink]


def window_mask(seq: int, window: int, device: torch.device) -> torch.Tensor:
    """``[seq, seq]``: True where a query sees a key of a ``window`` of tokens ending at itself (and not after)."""
    index = torch.arange(seq, device=device)
    distance = index[:, None] - index[None, :]
    return (distance >= 0) & (distance < window)


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
