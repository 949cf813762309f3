"""ZeRO-1's buckets: the gradients of many parameters reduce-scattered, and their updated slices all-gathered, by one
collective each (`lit3d.strategies.zero1.LocalShardOptimizer` moves its slices with them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lit3d.strategies.zero1 import _Entry

BUCKET_ELEMENTS = 50_000_000  # one collective moves at most this many elements per rank


def buckets(entries: list[_Entry]) -> list[Bucket]:
    """ZeRO-1 entries in groups moved by one collective each: same DP group and dtype, bounded size."""
    by_key: dict[tuple, list[list[_Entry]]] = {}
    for e in entries:
        groups = by_key.setdefault((e.dp[0], e.view.dtype, e.param.dtype), [[]])
        if groups[-1] and sum(x.slice_numel for x in groups[-1]) + e.slice_numel > BUCKET_ELEMENTS:
            groups.append([])
        groups[-1].append(e)
    return [Bucket(bucket) for groups in by_key.values() for bucket in groups]


class Bucket:
    """Entries moved by one collective. Every rank lays out a bucket as ``size`` rows of ``total`` elements, one
    row per rank, each holding that rank's slices at the same offsets (each slice padded to the largest).

    NOTE: on CPU the rows go out through an all-to-all that skips this rank's own row, for both the reduce-scatter
    and the all-gather: gloo's reduce-scatter and all-gather took 2.9x and 1.6x as long as that all-to-all of the
    same bytes (13 MB over 2 ranks: 22 and 12 ms against 7.4 ms, measured). So on CPU this rank's own row is the
    last and the others follow rank order; on GPUs row r is rank r's, as NCCL's collectives take them.
    """

    def __init__(self, entries: list[_Entry]) -> None:
        self.entries = entries
        sizes = [e.slice_numel for e in entries]
        self.offsets, self.total = [sum(sizes[:i]) for i in range(len(sizes))], sum(sizes)
        self.group, self.size, self.rank = entries[0].dp
        self.cpu = entries[0].view.device.type == "cpu"
        self._kept: dict[str, torch.Tensor] = {}
        self.pending: tuple | None = None  # a launched reduce-scatter: (its work, the tensor it lands in)
        self.ready = 0  # entries whose gradient backward has finished (`LocalShardOptimizer.overlap`)

    def row(self, rank: int) -> int:
        if not self.cpu:
            return rank
        return self.size - 1 if rank == self.rank else rank - (rank > self.rank)

    def rows(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """A ``[size, total]`` work buffer. NOTE: on CPU one is kept per key, the bytes of the widest dtype asked
        for (the bf16 gathers of master weights reuse the fp32 reduce's): a fresh buffer of this size comes from
        the OS as untouched pages, and faulting them in cost as much as the collective (measured: 13 MB over 2
        ranks, copy 10 -> 4 ms, all-to-all 21 -> 11 ms). CUDA's caching allocator reuses memory anyway."""
        view = self.entries[0].view
        if not self.cpu:
            return view.new_empty(self.size, self.total, dtype=dtype)
        nbytes = self.size * self.total * dtype.itemsize
        if key not in self._kept or self._kept[key].numel() < nbytes:
            self._kept[key] = view.new_empty(nbytes, dtype=torch.uint8)
        return self._kept[key][:nbytes].view(dtype).view(self.size, self.total)

    def _to_others(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Any:
        """CPU: row i of ``input`` to the i-th other rank, whose row for this rank lands in row i of ``output``."""
        splits = [int(r != self.rank) for r in range(self.size)]
        return torch.distributed.all_to_all_single(output[:-1], input[:-1], splits, splits, group=self.group,
                                                   async_op=async_op)  # fmt: skip

    def start_reduce_scatter(self, dtype: torch.dtype | None) -> None:
        """Launch the DP average of the gradients (not waiting for it), each rank to receive only its slices;
        the model's gradients are dropped: each rank keeps only the average of its slice."""
        send = self.rows("send", dtype or self.entries[0].view.dtype)  # its padding is never read: not zeroed
        for e, offset in zip(self.entries, self.offsets):
            grad = e.take_grad()
            grad = grad if grad is not None else torch.zeros_like(e.param)
            for rank, part in enumerate(e.slices(grad)):  # (bf16 gradients of master weights: upcast here)
                send[self.row(rank), offset : offset + part.numel()].copy_(part.reshape(-1))
        if self.cpu:
            received = self.rows("receive", send.dtype)
            work = self._to_others(received, send, async_op=True)
            self.pending = (work, received, send[-1])
        else:
            received = send.new_empty(self.total)
            work = torch.distributed.reduce_scatter_single(received, send.view(-1), group=self.group, async_op=True)
            self.pending = (work, received, None)

    def finish_reduce_scatter(self) -> None:
        """Wait for the launched reduce-scatter and hand the optimizer's views their averaged gradients."""
        work, received, own = self.pending
        self.pending = None
        work.wait()
        if own is not None:  # CPU: this rank's own row plus the rows the others sent it
            for row in received[:-1]:
                own.add_(row)
            received = own
        view = self.entries[0].view
        received = received.to(view.dtype).div_(self.size)
        for e, offset in zip(self.entries, self.offsets):
            e.view.grad = received[offset : offset + e.view.numel()].view(e.view.shape)

    def all_gather(self) -> None:
        """Replicate the updated slices over DP, in the parameters' dtype. The gradient views are dropped first: on
        CPU the buffers they point into carry the slices."""
        for e in self.entries:
            e.view.grad = None
        dtype = self.entries[0].param.dtype
        gathered = self.rows("receive", dtype)
        send = self.rows("send", dtype) if self.cpu else None
        mine = send[0] if self.cpu else self.entries[0].view.new_empty(self.total, dtype=dtype)
        for e, offset in zip(self.entries, self.offsets):
            mine[offset : offset + e.view.numel()].copy_(e.view.reshape(-1))
        if self.cpu:
            send[1:-1].copy_(mine.expand(self.size - 2, -1))  # the same row to every other rank
            self._to_others(gathered, send)
        else:
            torch.distributed.all_gather_single(gathered.view(-1), mine, group=self.group)
        for e, offset in zip(self.entries, self.offsets):
            for rank, target in enumerate(e.slices(e.param)):
                if rank != self.rank and target.numel():
                    target.copy_(gathered[self.row(rank), offset : offset + target.numel()].view(target.shape))


def rank_chunk(tensor: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """``torch.chunk``'s split of ``dim`` (the one DTensor's ``Shard`` uses, trailing parts may be empty)."""
    size = tensor.shape[dim]
    step = -(-size // parts)
    start = min(index * step, size)
    return tensor.narrow(dim, start, min(step, size - start))
