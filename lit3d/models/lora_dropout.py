"""LoRA's dropout, the same in every layout: each element's mask is drawn from where the element sits in the run.

`torch.nn.Dropout` draws a mask from the generator of the rank that computes it, so a rank holding half of a batch, of
a sequence or of the features draws other masks than one process does, and layouts part ways (one process and TP2
differed by 0.0145 in loss at step 19 with dropout 0.05, and more after). Here an adapter's input element is dropped
by a hash of integers (counter-based, as Philox is, and exact on every device) of

    the seed, the adapter (its module's name, and an expert's role), the sample (optimizer step x global batch + its
    place in the global batch), the token (its position in the whole sequence) and the feature (its index in the
    whole input; for an MoE expert's rows, the token and the expert),

so each rank draws exactly its elements' share of one process's masks, whatever it holds, and a forward recomputed in
backward draws them again. What a rank holds:

- rows: the training batch's samples (`Samples`, from `training_samples`: the sampler deals replica ``r`` of ``R`` the
  samples ``r, r + R, ...`` of each global batch, micro-step after micro-step), handed to the forward in the batch's
  `lit3d.models.batch_context.BatchContext`, which a pipeline splits into its micro-batches' rows, and with which a
  block recomputed in backward runs again;
- tokens: the whole sequence, or under context parallelism the true positions of this rank's chunks (the module's
  ``context_parallel``, set as on attention);
- features: a DTensor's shard offsets (a row-parallel adapter's input is a slice of its features; a column-parallel
  one's is whole).

Outside a training step of a lit3d module (a loop of one's own), it is `torch.nn.functional.dropout`.

NOTE: the hash runs on int64 tensors holding 32-bit values, multiplied by a constant below 2**27, so no product
overflows: the same bits on any backend. On the CPU it is a few eager passes over each adapter's input, its int64
scratch made in slices of `SLICE` elements (cheaper than `torch.nn.Dropout`'s random draws there); on GPUs one compiled
kernel (`fused_keep`). Measured in docs/fine-tuning.md.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

_BITS = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # the 32-bit integer hash's (Thomas Mueller's): a good avalanche, and below 2**27
SLICE = 1 << 22  # int64 elements of scratch per slice of rows


@dataclass(frozen=True)
class Samples:
    """The rows this rank computes: row i is sample ``ids[i]`` of the run, numbered optimizer step by step (step s's
    global batch holds samples ``s x global batch`` on); ``seed`` is the run's. A tensor of ids, so that a share of the
    rows (a pipeline's micro-batch) is a slice of it."""

    ids: torch.Tensor
    seed: int

    @classmethod
    def strided(cls, first: int, stride: int, count: int, seed: int, device: torch.device | None = None) -> Samples:
        """The samples ``first, first + stride, ...``, ``count`` of them."""
        return cls(first + stride * torch.arange(count, device=device), seed)


def training_samples(trainer: Any, batch_idx: int, rows: int, device: torch.device | None = None) -> Samples:
    """Where this replica's ``rows`` of training batch ``batch_idx`` sit in the run (their ids on ``device``): the
    samplers of lit3d's data deal replica ``r`` of ``R`` every R-th sample of each global batch from ``r``
    (`lit3d.data.sampler.GlobalBatchSampler`), or with ``data_parallel_shares`` its own run of them, micro-step after
    micro-step of the accumulation window."""
    dealt = trainer.distributed_sampler_kwargs or {}
    replicas, replica = dealt.get("num_replicas", 1), dealt.get("rank", 0)
    accumulate = trainer.accumulate_grad_batches
    micro_step = batch_idx % accumulate
    shares = getattr(getattr(trainer.strategy, "parallelism", None), "data_parallel_shares", None)
    if shares is not None:
        global_batch, first, stride = sum(shares), sum(shares[:replica]) + micro_step * rows, 1
    else:
        global_batch, first, stride = replicas * rows * accumulate, replica + micro_step * rows * replicas, replicas
    return Samples.strided(trainer.global_step * global_batch + first, stride, rows, torch.initial_seed(), device)


def mix(h: Any) -> Any:
    """A 32-bit integer hash of ``h`` (an int, or an int64 tensor of values below 2**32)."""
    h = ((h >> 16) ^ h) * _MULTIPLIER & _BITS
    h = ((h >> 16) ^ h) * _MULTIPLIER & _BITS
    return (h >> 16) ^ h


def keep_mask(row_keys: torch.Tensor, features: torch.Tensor, p: float) -> torch.Tensor:
    """``[*rows, features]``: which elements dropout keeps (a share ``1 - p``), from each row's key (hashed) and each
    element's global feature index."""
    keys = row_keys.flatten()
    feature_keys = mix(features ^ 0x9E3779B9)
    threshold = int(p * 2**32)
    if keys.is_cuda:  # one fused kernel: a byte written per element, where eager reads and writes about 50
        return fused_keep()(keys, feature_keys, threshold).view(*row_keys.shape, features.numel())
    keep = torch.empty(keys.numel(), features.numel(), dtype=torch.bool, device=keys.device)
    step = max(1, SLICE // max(1, features.numel()))
    for start in range(0, keys.numel(), step):  # `_keep`, in place
        scratch = keys[start : start + step, None] ^ feature_keys
        scratch.mul_(_MULTIPLIER).bitwise_and_(_BITS)
        torch.ge(scratch, threshold, out=keep[start : start + step])
    return keep.view(*row_keys.shape, features.numel())


def _keep(keys: torch.Tensor, feature_keys: torch.Tensor, threshold: int) -> torch.Tensor:
    return (keys[:, None] ^ feature_keys) * _MULTIPLIER & _BITS >= threshold


@functools.cache
def fused_keep() -> Any:
    """`keep_mask`'s arithmetic compiled into one kernel (GPUs: eager's int64 passes would cost about ten times torch's
    own dropout kernel in memory traffic). NOTE: compiled on its own, so it compiles inside the eager forward too."""
    return torch.compile(_keep, dynamic=True, fullgraph=True)


def _name_key(name: str, seed: int) -> int:
    return mix(mix(zlib.crc32(name.encode()) ^ (seed & _BITS)) ^ (seed >> 32 & _BITS))


class LayoutFreeDropout(nn.Module):
    """Dropout on an adapter's input ``[batch, seq, features]`` (plain or a DTensor), its mask the same in every layout
    (see the module's docstring). ``name`` (set by `name_dropouts`) keys the mask; ``context_parallel`` is set by the
    strategy as on attention."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p, self.name = p, ""
        self.context_parallel = (
            None  # `lit3d.models.ring_attention.ContextParallel`: this rank's tokens of each sequence
        )

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def active(self) -> bool:
        return self.training and self.p > 0

    # NOTE: eager under `compile`: the rows change every step (a compiled graph would be guarded on them).
    @torch.compiler.disable
    def forward(self, x: torch.Tensor, samples: Samples | None = None) -> torch.Tensor:
        """Dropout on ``x``, its mask keyed by the rows' ``samples`` (a training batch's; without: plain dropout)."""
        if not self.active():
            return x
        if samples is None:
            return F.dropout(x, self.p, training=True)
        held, offsets = _held(x)
        keys = self.token_keys(samples, x.shape[0], x.shape[1], x.device, offsets[:2], held[:2])
        features = offsets[2] + torch.arange(held[2], device=x.device)
        keep = keep_mask(keys, features, self.p)
        if _is_dtensor(x):  # its shard's mask, placed as it is
            from torch.distributed.tensor import DTensor

            stride = torch.empty(x.shape, device="meta").stride()
            keep = DTensor.from_local(keep, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=stride)
        return x * keep * (1 / (1 - self.p))

    def token_keys(
        self,
        samples: Samples,
        batch: int,
        seq: int,
        device: torch.device,
        offset: tuple[int, int] = (0, 0),
        held: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """``[rows, tokens]`` keys of the tokens this rank holds of a ``[batch, seq]`` forward (``held`` of them from
        ``offset``; default all) of the rows ``samples``, for this adapter."""
        if len(samples.ids) != batch:
            raise RuntimeError(f"LoRA dropout was given the samples of {len(samples.ids)} rows; a forward runs {batch}")
        rows, tokens = held or (batch, seq)
        ids = samples.ids.to(device)[offset[0] : offset[0] + rows]
        name = _name_key(self.name, samples.seed)
        row_keys = mix(mix(name ^ (ids & _BITS)) ^ (ids >> 32))
        cp = self.context_parallel
        if cp is not None and cp.size > 1:
            from lit3d.models.ring_attention import positions

            where = positions(seq, cp.size, cp.rank, device)[offset[1] : offset[1] + tokens]
        else:
            where = offset[1] + torch.arange(tokens, device=device)
        return mix(row_keys[:, None] ^ where)

    def on_rows(self, x: torch.Tensor, row_keys: torch.Tensor | None, role: str) -> torch.Tensor:
        """Dropout on ``x`` ``[rows, features]`` (whole features), each row keyed by ``row_keys`` (an MoE expert's
        rows: their token's key mixed with the expert's, `lit3d.models.moe.MoE`), for the projection ``role``."""
        if not self.active():
            return x
        if row_keys is None:
            return F.dropout(x, self.p, training=True)
        keys = mix(row_keys ^ _name_key(role, 0))
        keep = keep_mask(keys, torch.arange(x.shape[-1], device=x.device), self.p)
        return x * keep * (1 / (1 - self.p))


def _held(x: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of what this rank holds of ``x`` and where it starts in the whole: a DTensor's shard, else all."""
    if not _is_dtensor(x):
        return tuple(x.shape), (0,) * x.ndim
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
    return tuple(shape), tuple(offsets)


def _is_dtensor(x: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def name_dropouts(network: nn.Module) -> None:
    """Key each `LayoutFreeDropout` of ``network`` by its module's name (``blocks.3.attn.q_proj.dropout``): the same in
    every layout, since a pipeline stage or a split keeps the names."""
    for name, module in network.named_modules():
        if isinstance(module, LayoutFreeDropout):
            module.name = name
