"""ZeRO-1 by the ZeRO paper (P_os): the optimizer steps each rank's slice of every parameter, on plain local
tensors; the gradients are reduce-scattered to it in buckets and the updated slices all-gathered back (DDP's
bytes). Also the local-shard stepping every DTensor-sharded layout uses (`LocalShardOptimizer` without a mesh).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

ELEMENTWISE_OPTIMIZERS = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)


class LocalShardOptimizer:
    """Runs an elementwise optimizer on plain local tensors: each parameter's shard on this rank, and with
    ZeRO-1 only this DP rank's slice of it.

    AdamW and its kind update every element on its own, so stepping a shard computes exactly what stepping
    the whole tensor would, without DTensor's per-operation dispatch (on small models that costs more than the
    arithmetic). The optimizer's parameters are swapped for views of the shards (no copy): a step updates the
    model in place. Create it before the optimizer's first step.

    ZeRO-1 (``zero1_mesh``: the strategy's mesh, with a ``dp`` dim) is the ZeRO paper's P_os, in the bytes of
    DDP: the parameters stay replicated over DP and nothing syncs during backward; after it, `scatter_grads`
    reduce-scatters the gradients in buckets, so each rank receives the DP average of only its slice (the model's
    own gradients are then dropped), the optimizer steps the slices, and `gather_params` all-gathers the updated
    slices back into every replica. Each parameter is split along a tensor dim that TP leaves whole; the optimizer
    states are 1/D the size, and `as_global` places them in the global tensor for checkpoints.
    ``reduce_dtype`` (e.g. bf16) is the dtype the gradients travel in; the average lands in the parameter's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, zero1_mesh: DeviceMesh | None = None,
                 reduce_dtype: torch.dtype | None = None, module: nn.Module | None = None,
                 expert_mesh: DeviceMesh | None = None) -> None:  # fmt: skip
        if zero1_mesh is not None and not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
            raise TypeError(
                f"{type(optimizer).__name__} is not one of the elementwise optimizers "
                f"({', '.join(o.__name__ for o in ELEMENTWISE_OPTIMIZERS)}) that ZeRO-1 can shard; "
                "use zero_stage 0, 2 or 3"
            )
        if optimizer.state:
            raise RuntimeError("the optimizer's parameters must be swapped before its first step")
        self.mesh, self.reduce_dtype, self.expert_mesh = zero1_mesh, reduce_dtype, expert_mesh
        self.entries: list[_Entry] = []
        for group in optimizer.param_groups:
            entries = [self._entry(p) for p in group["params"]]
            self.entries += entries
            group["params"] = [e.view for e in entries]
        self._by_view = {id(e.view): e for e in self.entries}
        sliced = [e for e in self.entries if e.dim is not None]
        if module is not None:  # buckets in the order backward finishes the gradients: the module's last first
            index = {id(p): i for i, p in enumerate(module.parameters())}
            sliced.sort(key=lambda e: -index.get(id(e.param), -1))
        self._buckets = _buckets(sliced)
        self._hooks: list[Any] = []
        self._launched: int | None = None  # inside `overlap`: buckets up to this index have started

    def _entry(self, param: torch.Tensor) -> _Entry:
        if self.mesh is None:
            if not isinstance(param, DTensor):
                return _Entry(param, param)
            entry = _Entry(param, None, param.device_mesh, tuple(param.placements))
        elif isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == ("ep",):
            entry = self._expert_entry(param)
        else:
            tp = tuple(param.placements) if isinstance(param, DTensor) else ()
            if isinstance(param, DTensor) and param.device_mesh.mesh_dim_names != ("tp",):
                raise TypeError(f"ZeRO-1 expects plain or tensor-parallel parameters, got {param.placements}")
            taken = {p.dim for p in tp if isinstance(p, Shard)}
            dim = next((d for d in range(param.ndim) if d not in taken), None)
            if dim is None:
                raise ValueError(f"no dim of a {tuple(param.shape)} parameter is free for ZeRO-1 sharding")
            mesh = self.mesh["dp", "tp"] if tp else self.mesh["dp"]
            entry = _Entry(param, None, mesh, (Shard(dim), *tp), dim)
            entry.tp_sharded = bool(taken)
        entry.view = nn.Parameter(entry.local(param).detach(), requires_grad=param.requires_grad)
        return entry

    def _expert_entry(self, param: DTensor) -> _Entry:
        """An MoE expert weight, split over the EP ranks (dim 0), sliced and averaged over the ``edp`` ranks that
        hold the same experts (with a single such group, nothing to average). Its gradient comes scaled already
        (`lit3d.moe.Experts.grad_scale`)."""
        if self.expert_mesh["edp"].size() == 1:
            return _Entry(param, None, param.device_mesh, tuple(param.placements))
        mesh = self.expert_mesh["edp", "ep"]
        return _Entry(param, None, mesh, (Shard(1), *param.placements), 1, dp_dim="edp")

    @property
    def zero1(self) -> bool:
        return self.mesh is not None

    @contextmanager
    def overlap(self) -> Iterator[None]:
        """ZeRO-1: inside, each bucket's reduce-scatter starts as soon as backward has finished its gradients, in
        the background while backward goes on (as DDP's all-reduce does). For the one backward before a step:
        not for a pipeline schedule's, which finishes each gradient once per micro-batch.

        Buckets start in one fixed order on every rank (a bucket waits for those before it), so the collectives
        match even where a parameter gets no gradient on some rank; `scatter_grads` starts whatever is left.
        """
        if not self._hooks:
            for i, bucket in enumerate(self._buckets):
                for e in bucket.entries:
                    self._hooks.append(e.param.register_post_accumulate_grad_hook(partial(self._grad_ready, i)))
        for bucket in self._buckets:
            bucket.ready = 0
        self._launched = -1
        try:
            yield
        finally:
            self._launched = None

    @torch.no_grad()
    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        if self._launched is None:  # not inside `overlap`
            return
        self._buckets[index].ready += 1
        while self._launched + 1 < len(self._buckets):
            bucket = self._buckets[self._launched + 1]
            if bucket.ready < len(bucket.entries):
                break
            bucket.start_reduce_scatter(self.reduce_dtype)
            self._launched += 1

    @torch.no_grad()
    def scatter_grads(self) -> None:
        """Hand the optimizer its views of the gradients; with ZeRO-1, their DP averages (a reduce-scatter)."""
        for bucket in self._buckets:
            if bucket.pending is None:
                bucket.start_reduce_scatter(self.reduce_dtype)
        for bucket in self._buckets:
            bucket.finish_reduce_scatter()
        for e in self.entries:
            if e.view is not e.param and e.dim is None:
                e.view.grad = None if e.param.grad is None else e.local(e.param.grad)

    @torch.no_grad()
    def gather_params(self) -> None:
        for bucket in self._buckets:
            bucket.all_gather()
        for e in self.entries:
            if e.view is not e.param:
                # The model's gradients are what backward accumulates into; the step has consumed them.
                e.param.grad = e.view.grad = None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, pipeline_group: Any = None) -> torch.Tensor:
        """ZeRO-1: scale the gradient slices so the whole model's gradient norm is at most ``max_norm``.

        The slices are disjoint over DP and TP-sharded tensors over TP, while a tensor TP replicates is counted on
        the first TP rank only; so one sum of squares per rank, summed over DP, TP and the pipeline, is the norm.
        (Plain tensors: DTensor's dispatch would cost more than the arithmetic.)
        """
        mesh, grads = self.mesh, [e.view.grad for e in self.entries if e.view.grad is not None]
        first_tp = "tp" not in mesh.mesh_dim_names or mesh["tp"].get_local_rank() == 0
        counted = [e.view.grad for e in self.entries if e.view.grad is not None and (first_tp or e.tp_sharded)]
        squared = sum((g.float().square().sum() for g in counted), torch.zeros((), device=grads[0].device))
        for dim in ("dp", "tp", "pp"):
            group = pipeline_group if dim == "pp" else mesh[dim].get_group() if dim in mesh.mesh_dim_names else None
            if group is not None and torch.distributed.get_world_size(group) > 1:
                torch.distributed.all_reduce(squared, group=group)
        norm = squared.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return norm

    def as_global(self, view: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """A state tensor of ``view`` (exp_avg, ...) as a DTensor placed in the parameter's global shape, sharing
        its storage; scalars (the step count) stay as they are. For checkpoints that any layout can read."""
        entry = self._by_view[id(view)]
        if entry.placements is None or state.shape != view.shape:
            return state
        shape = entry.param.shape
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(state, entry.mesh, entry.placements, run_check=False, shape=shape, stride=stride)


class _Entry:
    """One parameter: the model's parameter, the plain view the optimizer steps, and where that view lies in the
    global tensor (``mesh`` and ``placements``; ``dim``: the dim ZeRO-1 splits over DP)."""

    def __init__(self, param: torch.Tensor, view: torch.Tensor | None, mesh: Any = None, placements: Any = None,
                 dim: int | None = None, dp_dim: str = "dp") -> None:  # fmt: skip
        self.param, self.view, self.mesh, self.placements, self.dim = param, view, mesh, placements, dim
        self.dp_dim = dp_dim  # the mesh dim ZeRO-1 slices over ("edp" for MoE experts)
        self.tp_sharded = False  # split over TP: every TP rank's part counts in the gradient norm

    @functools.cached_property
    def dp(self) -> tuple[Any, int, int]:
        """(process group, size, this rank's index) of the DP dim."""
        dp = self.mesh[self.dp_dim]
        return dp.get_group(), dp.size(), dp.get_local_rank()

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``tensor`` (the parameter or its gradient) that the optimizer steps, as a view."""
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if self.dim is None:
            return local
        _, size, rank = self.dp
        return _rank_chunk(local, self.dim, size, rank)

    def slices(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every DP rank's slice of ``tensor``'s local part (torch.chunk's split, as DTensor's ``Shard``)."""
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        _, size, _ = self.dp
        return [_rank_chunk(local, self.dim, size, r) for r in range(size)]

    @functools.cached_property
    def slice_numel(self) -> int:
        """Elements of the largest DP slice (what each rank contributes to a collective, padded)."""
        return max(s.numel() for s in self.slices(self.param))


BUCKET_ELEMENTS = 50_000_000  # one collective moves at most this many elements per rank


def _buckets(entries: list[_Entry]) -> list[_Bucket]:
    """ZeRO-1 entries in groups moved by one collective each: same DP group and dtype, bounded size."""
    buckets: dict[tuple, list[list[_Entry]]] = {}
    for e in entries:
        groups = buckets.setdefault((e.dp[0], e.view.dtype), [[]])
        if groups[-1] and sum(x.slice_numel for x in groups[-1]) + e.slice_numel > BUCKET_ELEMENTS:
            groups.append([])
        groups[-1].append(e)
    return [_Bucket(bucket) for groups in buckets.values() for bucket in groups]


class _Bucket:
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
        self._kept: dict[tuple, torch.Tensor] = {}
        self.pending: tuple | None = None  # a launched reduce-scatter: (its work, the tensor it lands in)
        self.ready = 0  # entries whose gradient backward has finished (`LocalShardOptimizer.overlap`)

    def row(self, rank: int) -> int:
        if not self.cpu:
            return rank
        return self.size - 1 if rank == self.rank else rank - (rank > self.rank)

    def rows(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """A ``[size, total]`` work buffer. NOTE: on CPU one is kept per (key, dtype): a fresh buffer of this size
        comes from the OS as untouched pages, and faulting them in cost as much as the collective (measured: 13 MB
        over 2 ranks, copy 10 -> 4 ms, all-to-all 21 -> 11 ms). CUDA's caching allocator reuses memory anyway."""
        view = self.entries[0].view
        if not self.cpu:
            return view.new_empty(self.size, self.total, dtype=dtype)
        if (key, dtype) not in self._kept:
            self._kept[key, dtype] = view.new_empty(self.size, self.total, dtype=dtype)
        return self._kept[key, dtype]

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
            grad = e.param.grad if e.param.grad is not None else torch.zeros_like(e.param)
            if isinstance(grad, DTensor) and grad.placements != e.param.placements:
                # e.g. the tied embedding's gradient, still replicated when backward hands it over: take its shard
                grad = grad.redistribute(placements=e.param.placements)
            for rank, part in enumerate(e.slices(grad)):
                send[self.row(rank), offset : offset + part.numel()].copy_(part.reshape(-1))
            e.param.grad = None
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
        """Replicate the updated slices over DP. The gradient views are dropped first: on CPU the buffers they
        point into carry the slices."""
        for e in self.entries:
            e.view.grad = None
        view = self.entries[0].view
        gathered = self.rows("receive", view.dtype)
        send = self.rows("send", view.dtype) if self.cpu else None
        mine = send[0] if self.cpu else view.new_empty(self.total)
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


def _rank_chunk(tensor: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """``torch.chunk``'s split of ``dim`` (the one DTensor's ``Shard`` uses, trailing parts may be empty)."""
    size = tensor.shape[dim]
    step = -(-size // parts)
    start = min(index * step, size)
    return tensor.narrow(dim, start, min(step, size - start))
