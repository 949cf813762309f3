"""Context parallelism: every sequence split over ``cp`` ranks, attention as a ring.

Which tokens a rank holds. Causal attention makes late tokens cost more than early ones, so the sequence is cut
into ``2·cp`` chunks and rank ``c`` holds chunks ``c`` and ``2·cp−1−c`` (one early, one late): every rank does
the same work. `shard_sequence` cuts a batch so, `positions` gives each held token its true position (rotary).

Ring attention. A rank's queries need the keys and values of every chunk before them. The K/V blocks travel
around the CP ring, one hop per step (``cp − 1`` hops; only the K/V heads travel under grouped-query attention),
and the next block is already on its way while this one is computed. Each step's partial output is merged with
the running one by their log-sum-exps, which is exact. With the chunk order above, no step needs a mask:

    step 0 (own block)      causal attention of the rank's tokens among themselves
    from an earlier rank    all the rank's queries against the block's first (earlier) chunk
    from a later rank       the rank's second (late) chunk of queries against the whole block

A sliding window (gpt-oss, Gemma 3) masks each block by the tokens' true positions, and a block none of whose keys
any query here can see is skipped (its K/V still travel on); attention sinks join the merged softmax once, at the end.

Backward runs the same ring again: each block's K/V gradient travels with the block, collecting every rank's
contribution, and one last hop brings it home (``cp`` hops). Per layer a rank sends ``(cp − 1)`` K/V blocks in
forward and ``(cp − 1)`` K/V blocks plus ``cp`` K/V gradient blocks (in fp32) in backward
(`ring_bytes_per_layer`).

NOTE: written here rather than taken from PyTorch's ``context_parallel``: PyTorch's ring replaces the CUDA SDPA
kernels (flash, efficient, cuDNN) by dispatch on DTensors and does not handle the CPU kernel, on which this
library's parity tests run. So one ring, on the attention kernel that returns the log-sum-exp (on CPU
``_scaled_dot_product_flash_attention_for_cpu``, on CUDA the flash kernel in bf16/fp16), with
``torch.distributed``'s point-to-point ops, runs on both: the CPU tests check the same code the GPUs run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lit3d.models.documents import Documents, attention_mask

aten = torch.ops.aten


@dataclass(frozen=True)
class ContextParallel:
    """Where a module's sequence lives: ``size`` ranks of ``group``, this one at ``rank`` (its index there)."""

    group: Any
    size: int
    rank: int


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two of the ``2·cp`` sequence chunks that CP rank ``rank`` holds (one early, one late)."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(tensor: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens of ``tensor`` along ``dim``: its two chunks, early one first."""
    if cp == 1:
        return tensor
    chunks = tensor.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp, rank)], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence back from every CP rank's `shard_sequence` (in rank order)."""
    cp = len(shards)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=dim)
        chunks[chunk_ids(cp, rank)[0]], chunks[chunk_ids(cp, rank)[1]] = first, second
    return torch.cat(chunks, dim=dim)


def positions(local_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """True positions of the ``local_len`` tokens CP rank ``rank`` holds."""
    half = local_len // 2
    first, second = (i * half for i in chunk_ids(cp, rank))
    return torch.cat(
        (torch.arange(first, first + half, device=device), torch.arange(second, second + half, device=device))
    )


@torch.compiler.disable  # point-to-point communication inside: stays eager under torch.compile
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: ContextParallel,
    documents: Documents | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of the CP-sharded sequence; tensors ``[batch, seq, heads, head_dim]`` as in
    `lit3d.models.attention`, ``seq`` being this rank's tokens (`shard_sequence`); with packed ``documents`` (this
    rank's share, `lit3d.models.documents`) a query meets only the keys of its own document; with a ``window`` only
    the last ``window`` tokens (itself included: a visiting block none of whose keys a query here can see is skipped,
    the others masked by the tokens' true positions); with ``sinks`` (one logit per head of q, this rank's heads) each
    softmax's denominator gets ``exp(sink)`` more; ``scale``: the scores' factor (1/√head_dim unless given).

    NOTE: a sink joins once, after the last block: the merged output times ``exp(lse − logaddexp(lse, sink))`` is the
    softmax over the keys and the sink (whose value is zero). Backward then runs each block's kernel on that final
    output and log-sum-exp, which gives the sink-inclusive gradients of q, k and v, and the sink's own gradient is
    ``−exp(sink − lse) · Σ grad_out · out`` per query, summed over this rank's queries."""
    if q.shape[1] % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks; got {q.shape[1]} tokens")
    if scale is not None:  # (the kernels scale by 1/√head_dim)
        q = q * (scale * math.sqrt(q.shape[-1]))
    out = _RingAttention.apply(*(t.transpose(1, 2) for t in (q, k, v)), sinks, cp, documents, window)
    return out.transpose(1, 2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        cp: ContextParallel,
        docs: Documents | None,
        window: int | None,
    ) -> torch.Tensor:
        ring = _Ring(cp)
        half = q.shape[2] // 2
        # NOTE: laid out [b, s, h, d] in memory, as the model reads it: the caller's reshape is then a view, and
        # the tensor saved here is the one the output projection saves.
        (b, h, s, _), width = q.shape, v.shape[-1]
        out = torch.zeros(b, s, h, width, dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        block = torch.cat((k, v), dim=-1).contiguous()  # one tensor travels: each K head, then its V head
        for step in range(cp.size):
            incoming = ring.pass_on(block) if step + 1 < cp.size else None
            rows, keys, causal = _block(step, cp, half)
            mask = _block_mask(docs, window, step, cp, rows, keys, causal, q)
            if mask is None or mask.any():
                kk, vv = _expand(block[:, :, keys], q.shape[1], width)
                part_out, part_lse = _attend(q[:, :, rows], kk, vv, causal, mask)
                _merge(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
            if incoming is not None:
                block = incoming.wait()
        if sinks is not None:
            total = torch.logaddexp(lse, sinks.detach().float().view(1, -1, 1))
            out.mul_(torch.exp(lse - total).unsqueeze(-1))
            lse = total
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.cp, ctx.docs, ctx.window = cp, docs, window
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        cp, ring = ctx.cp, _Ring(ctx.cp)
        grad_out, half, groups = grad_out.contiguous(), q.shape[2] // 2, q.shape[1] // k.shape[1]
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        block, grads, arriving = torch.cat((k, v), dim=-1).contiguous(), None, None
        for step in range(cp.size):
            incoming = ring.pass_on(block) if step + 1 < cp.size else None
            rows, keys, causal = _block(step, cp, half)
            mask = _block_mask(ctx.docs, ctx.window, step, cp, rows, keys, causal, q)
            if mask is None or mask.any():
                kk, vv = _expand(block[:, :, keys], q.shape[1], v.shape[-1])
                dq, dk, dv = _attend_backward(
                    grad_out[:, :, rows], q[:, :, rows], kk, vv, out[:, :, rows], lse[:, :, rows], causal, mask
                )
                grad_q[:, :, rows] += dq
                part = torch.cat((_fold(dk, groups), _fold(dv, groups)), dim=-1)
                if keys != slice(None):  # only the visiting block's first chunk was met: the rest gets no gradient
                    part = torch.cat((part, part.new_zeros(part.shape)), dim=2)
            else:  # a block the window hides from every query here
                part = torch.zeros(block.shape, dtype=torch.float32, device=block.device)
            grads = part if arriving is None else arriving.wait().add_(part)
            arriving = ring.pass_on(grads)  # on to the next rank; after the last step, home to its owner
            if incoming is not None:
                block = incoming.wait()
        grad_k, grad_v = arriving.wait().split([k.shape[-1], v.shape[-1]], dim=-1)
        grad_sinks = None
        if sinks is not None:  # (see `ring_attention`)
            kept = (grad_out.float() * out.float()).sum(dim=-1)
            grad_sinks = -(torch.exp(sinks.float().view(1, -1, 1) - lse) * kept).sum(dim=(0, 2)).to(sinks.dtype)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), grad_sinks, None, None, None


def _block(step: int, cp: ContextParallel, half: int) -> tuple[slice, slice, bool]:
    """At ``step``, which of this rank's query rows meet which rows of the visiting block, and whether causally."""
    source = (cp.rank - step) % cp.size
    everything = slice(None)
    if step == 0:
        return everything, everything, True
    if source < cp.rank:  # an earlier rank: its early chunk precedes both of ours, its late chunk follows both
        return everything, slice(0, half), False
    return slice(half, None), everything, False  # a later rank: both its chunks precede only our late one


def _expand(block: torch.Tensor, heads: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (``width`` wide) of a block, their heads repeated for the query heads (grouped-query attention)."""
    k, v = block.split([block.shape[-1] - width, width], dim=-1)
    groups = heads // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return k.contiguous(), v.contiguous()


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """A K/V gradient over the repeated heads summed back onto the K/V heads."""
    if groups == 1:
        return grad.float()
    b, h, s, d = grad.shape
    return grad.float().view(b, h // groups, groups, s, d).sum(dim=2)


def _block_mask(
    docs: Documents | None,
    window: int | None,
    step: int,
    cp: ContextParallel,
    rows: slice,
    keys: slice,
    causal: bool,
    held: torch.Tensor,
) -> torch.Tensor | None:
    """Which of the visiting block's keys each of this step's queries may meet (``[batch or 1, 1, q, k]``), for packed
    documents and a window (by the tokens' true positions: `positions`; ``held``: a tensor of this rank's queries,
    ``[b, h, seq, d]``); None: all (causally at step 0)."""
    source, mask = (cp.rank - step) % cp.size, None
    if docs is not None:
        key_segments = shard_sequence(docs.whole_segments, cp.size, source)[:, keys]
        mask = attention_mask(docs.segments[:, rows], key_segments, causal)
    if window is not None:
        local, device = held.shape[2], held.device
        distance = (
            positions(local, cp.size, cp.rank, device)[rows, None] - positions(local, cp.size, source, device)[keys]
        )
        seen = ((distance >= 0) & (distance < window))[None, None]
        mask = seen if mask is None else mask & seen
    return mask


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and log-sum-exp (fp32, ``[b, h, s]``)."""
    if mask is not None:
        return _attend_masked(q, k, v, mask)
    q, width = q.contiguous(), v.shape[-1]
    v = _widened(v, q.shape[-1])
    if q.device.type == "cuda":
        _check_cuda_dtype(q)
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    else:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out[..., :width], lse


def _attend_backward(grad_out, q, k, v, out, lse, causal, mask=None):
    if mask is not None:
        return _attend_masked_backward(grad_out, q, k, v, out, lse, mask)
    width, full = v.shape[-1], q.shape[-1]
    grad_out, out, v = (_widened(t, full) for t in (grad_out.contiguous(), out, v))
    q, out, lse = q.contiguous(), out.contiguous(), lse.contiguous()
    if q.device.type == "cuda":
        none, length = torch.empty(0, device=q.device), q.shape[2]
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, none, none, length, k.shape[2], 0.0, causal, seed, offset
        )[:3]
    else:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal)
    return dq, dk, dv[..., :width]


def _widened(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` padded with zero columns to ``width`` (the fused kernels take one head width for q, k and v).

    NOTE: latent attention's values are narrower than its queries and keys (DeepSeek-V3: 128 against 192). Zero value
    columns change no score and no kept output column; in backward the output and its gradient get zero columns too,
    so each row's ``sum(grad_out · out)`` is unchanged, and the value gradient's extra columns are dropped."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


# NOTE: the fused kernels that return the log-sum-exp take no mask; a block of packed documents is computed in plain
# PyTorch (fp32 scores of one block: the memory of one block's attention matrix).


def _masked_scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~mask, float("-inf"))


def _attend_masked(q, k, v, mask):
    """`_attend` with a mask; a query that may meet none of the block's keys gets output 0 and log-sum-exp -inf."""
    scores = _masked_scores(q, k, mask)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(weights, v.float()).to(q.dtype), lse


def _attend_masked_backward(grad_out, q, k, v, out, lse, mask):
    """The gradients of `_attend_masked`'s block, given the merged output and log-sum-exp of its queries."""
    weights = torch.exp(_masked_scores(q, k, mask) - lse.unsqueeze(-1))
    grad_out = grad_out.float()
    grad_v = torch.matmul(weights.transpose(-1, -2), grad_out)
    grad_weights = torch.matmul(grad_out, v.float().transpose(-1, -2))
    grad_scores = weights * (grad_weights - (grad_out * out.float()).sum(dim=-1, keepdim=True))
    scale = 1 / math.sqrt(q.shape[-1])
    grad_q = torch.matmul(grad_scores, k.float()) * scale
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q.float()) * scale
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


def _check_cuda_dtype(q: torch.Tensor) -> None:
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise RuntimeError(
            f"context parallelism on CUDA runs the flash kernel, in bf16 or fp16, not {q.dtype}: train with "
            "precision='bf16-mixed' (or bf16-true), or on CPU for fp32"
        )


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's softmax-normalised output into the running (fp32) one, in place (views of the rows)."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(
        block_out.float() * torch.exp(block_lse - merged).unsqueeze(-1)
    )
    lse.copy_(merged)


class _Ring:
    """One hop around the CP ring: send to the next rank, receive from the previous one, in the background."""

    def __init__(self, cp: ContextParallel) -> None:
        ranks = dist.get_process_group_ranks(cp.group)
        self.group, self.next, self.prev = cp.group, ranks[(cp.rank + 1) % cp.size], ranks[(cp.rank - 1) % cp.size]

    def pass_on(self, tensor: torch.Tensor) -> _Arrival:
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group),
            dist.P2POp(dist.irecv, received, self.prev, self.group),
        ]
        return _Arrival(dist.batch_isend_irecv(ops), received)


@dataclass
class _Arrival:
    requests: list[Any]
    tensor: torch.Tensor

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        return self.tensor
