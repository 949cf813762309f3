"""ZeRO-1's buckets: the gradients of many parameters reduce-scattered, and their updated slices all-gathered, by one
collective each (`lit3d.strategies.optim.zero1.LocalShardOptimizer` moves its slices with them)."""

from __future__ import annotations

from typing import Any

import torch

from lit3d.parallel.sharding import BUCKET_ELEMENTS
from lit3d.strategies.optim.zero1_params import SlicedParam
from lit3d.strategies.torch_compat import all_gather_single, reduce_scatter_single


def buckets(entries: list[SlicedParam]) -> list[Bucket]:
    """ZeRO-1 entries in groups moved by one collective each: same DP group and dtype, bounded size."""
    by_key: dict[tuple, list[list[SlicedParam]]] = {}
    for e in entries:
        groups = by_key.setdefault((e.dp[0], e.view.dtype, e.param.dtype), [[]])
        if groups[-1] and sum(x.slice_numel for x in groups[-1]) + e.slice_numel > BUCKET_ELEMENTS:
            groups.append([])
        groups[-1].append(e)
    return [Bucket(bucket) for groups in by_key.values() for bucket in groups]


class Bucket:
    """Entries moved by one collective. Every rank lays out a bucket's gradients as ``size`` rows of ``total``
    elements, one row per rank, each holding that rank's slices at the same offsets (each slice padded to the
    largest).

    Those rows (``grads``) are the only whole gradient of the bucket a rank holds, as Megatron's main_grad buffer
    but one bucket at a time: each parameter's gradient is added to them, in the optimizer's dtype (fp32 under
    master weights), as soon as backward has finished it, and the parameter's own is dropped. They are made zero at
    the step's first gradient, sum gradient accumulation's micro-steps and a pipeline's micro-batches, and are freed
    once their reduce-scatter is done (`finish_reduce_scatter`).

    NOTE: on CPU the rows go out through an all-to-all that skips this rank's own row, for both the reduce-scatter
    and the all-gather: gloo's reduce-scatter and all-gather took 2.9x and 1.6x as long as that all-to-all of the
    same bytes (13 MB over 2 ranks: 22 and 12 ms against 7.4 ms, measured), and gloo's reduce-scatter copies its
    whole input. So on CPU this rank's own row is the last and the others follow rank order; on GPUs row r is rank
    r's, as NCCL's collectives take them. Over 2 ranks both paths hold the same bytes (over more, the CPU path holds
    a few more rows while a collective runs).
    """

    def __init__(self, entries: list[SlicedParam]) -> None:
        self.entries = entries
        sizes = [e.slice_numel for e in entries]
        self.offsets, self.total = [sum(sizes[:i]) for i in range(len(sizes))], sum(sizes)
        self._offset = {id(e): offset for e, offset in zip(entries, self.offsets)}
        self.group, self.size, self.rank = entries[0].dp
        self.replicate = entries[0].replicate  # HSDP: the other shard groups', which sum the slices too
        self.cpu = entries[0].view.device.type == "cpu"
        self.grads: torch.Tensor | None = None  # this step's gradient sums, ``[size, total]``, until reduce-scattered
        self.pending: tuple | None = None  # a launched reduce-scatter: its work, the tensor it lands in, its input
        self.ready = 0  # entries whose gradient backward has finished (`LocalShardOptimizer.overlap`)

    def row(self, rank: int) -> int:
        if not self.cpu:
            return rank
        return self.size - 1 if rank == self.rank else rank - (rank > self.rank)

    @torch.no_grad()
    def add_grad(self, entry: SlicedParam) -> None:
        """Add the gradient left on ``entry``'s parameter to the bucket's rows (made zero at the step's first), and
        drop it from the parameter. Exact: the rows hold what the parameter's own gradient would sum."""
        grad, entry.param.grad = entry.param.grad, None
        if grad is None:
            return
        if self.grads is None:
            self.grads = entry.view.new_zeros(self.size, self.total)
        offset = self._offset[id(entry)]
        for rank, part in enumerate(entry.slices(entry.like_param(grad))):  # (bf16 gradients of master weights too)
            self.grads[self.row(rank), offset : offset + part.numel()].view(part.shape).add_(part)

    def _to_others(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Any:
        """CPU: row i of ``input`` to the i-th other rank, whose row for this rank lands in row i of ``output``."""
        splits = [int(r != self.rank) for r in range(self.size)]
        return torch.distributed.all_to_all_single(output, input, splits, splits, group=self.group, async_op=async_op)

    @torch.no_grad()
    def start_reduce_scatter(self, dtype: torch.dtype | None) -> None:
        """Launch the DP sum of the rows (not waiting for it), in ``dtype`` if given, each rank to receive only its
        slices. A gradient still on a parameter (one set without its hook, e.g. by a zero-bubble schedule's weight
        pass) joins the rows first; a bucket that got no gradient sends zeros."""
        for e in self.entries:
            self.add_grad(e)
        rows, self.grads = self.grads, None
        rows = rows if rows is not None else self.entries[0].view.new_zeros(self.size, self.total)
        send = rows if dtype is None else rows.to(dtype)
        del rows  # NOTE: rows cast for the wire are freed here, before the collective's buffers are made
        if self.cpu:
            received = send.new_empty(self.size - 1, self.total)
            work = self._to_others(received, send[:-1], async_op=True)
        else:
            received = send.new_empty(self.total)
            work = reduce_scatter_single(received, send.view(-1), group=self.group, async_op=True)
        self.pending = (work, received, send)

    @torch.no_grad()
    def finish_reduce_scatter(self) -> None:
        """Wait for the launched reduce-scatter, free what it sent, and hand the optimizer's views their averaged
        gradients."""
        work, received, send = self.pending
        self.pending = None
        work.wait()
        if self.cpu:  # the rows the others sent this rank plus its own, summed in the first (a + b is b + a)
            summed = received[0].add_(send[-1])
            for row in received[1:]:
                summed.add_(row)
            received = summed.clone() if self.size > 2 else summed
        del send
        replicas = 1
        if self.replicate is not None:  # HSDP: the shard groups sum their slices, in the wire's dtype
            group, replicas = self.replicate
            torch.distributed.all_reduce(received, group=group)
        view = self.entries[0].view
        received = received.to(view.dtype).div_(self.size * replicas)
        for e, offset in zip(self.entries, self.offsets):
            e.view.grad = received[offset : offset + e.view.numel()].view(e.view.shape)

    @torch.no_grad()
    def all_gather(self) -> None:
        """Replicate the updated slices over DP, in the parameters' dtype. The gradient views are dropped first, so
        their bytes are free for the gathered rows."""
        for e in self.entries:
            e.view.grad = None
        dtype, view = self.entries[0].param.dtype, self.entries[0].view
        rows = self.size - 1 if self.cpu else self.size  # CPU: the other ranks' rows only
        gathered = view.new_empty(rows, self.total, dtype=dtype)
        send = view.new_empty(self.size - 1, self.total, dtype=dtype) if self.cpu else None
        mine = send[0] if self.cpu else view.new_empty(self.total, dtype=dtype)
        for e, offset in zip(self.entries, self.offsets):
            mine[offset : offset + e.view.numel()].view(e.view.shape).copy_(e.view)
        if self.cpu:
            send[1:].copy_(mine.expand(self.size - 2, -1))  # the same row to every other rank
            self._to_others(gathered, send)
        else:
            all_gather_single(gathered.view(-1), mine, group=self.group)
        for e, offset in zip(self.entries, self.offsets):
            for rank, target in enumerate(e.slices(e.param)):
                if rank != self.rank and target.numel():
                    target.copy_(gathered[self.row(rank), offset : offset + target.numel()].view(target.shape))
