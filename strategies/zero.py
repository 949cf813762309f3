"""Data parallelism with ZeRO sharding over the DP mesh dimension, from PyTorch's FSDP2 building blocks.

==========  ==================  ================  ==============  ============================================
zero_stage  parameters          gradients         optimizer       built from
==========  ==================  ================  ==============  ============================================
0           replicated          all-reduced       replicated      DDP, or ``replicate``
1           replicated          all-reduced       sharded (1/D)   ``replicate`` + `LocalShardOptimizer`
2           gathered once/step  reduce-scattered  sharded         ``fully_shard(reshard_after_forward=False)``
3           gathered per block  reduce-scattered  sharded         ``fully_shard``
==========  ==================  ================  ==============  ============================================

ZeRO-0 on a network that is data parallel only is PyTorch's DDP (its composable ``replicate``): gradients go out
in buckets of about 25 MB, all-reduced in the background while backward goes on, as Lightning's ``ddp`` does.
DDP takes neither DTensor parameters nor a pipeline schedule's micro-batches, so with TP or PP, ZeRO-0 is FSDP2's
``replicate``: one all-reduce per block, issued in order (it overlaps through CUDA streams, not on CPU).

Stage 2 gathers each block's parameters in forward and keeps them until its backward is done (no second
gather), then frees them: between steps a rank holds only its shard, as in stage 3.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard


def apply_data_parallel(
    network: nn.Module,
    blocks: list[nn.Module],
    dp_mesh: DeviceMesh,
    zero_stage: int,
    mp_policy: Any = None,
    *,
    data_parallel_only: bool = False,
) -> None:
    """Make ``network`` data parallel over ``dp_mesh`` in place; each of ``blocks`` is one communication unit.

    ``data_parallel_only``: the network is neither tensor- nor pipeline-parallel, so ZeRO-0 can be PyTorch's DDP.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if zero_stage == 0 and data_parallel_only:
        from torch.distributed._composable.replicate import replicate

        # NOTE: no broadcast at the first forward (every rank initialises the same weights from the same seed),
        # none per forward (the only buffers, the rotary tables, are computed, not learnt), and gradients are
        # views of DDP's buckets rather than copies of them.
        replicate(
            network,
            process_group=dp_mesh.get_group(),
            init_sync=False,
            forward_sync_buffers=False,
            gradient_as_bucket_view=True,
        )
        return
    mp_policy = mp_policy or MixedPrecisionPolicy()
    if zero_stage <= 1:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        # One gradient all-reduce per block, issued as soon as backward is done with it (overlaps the rest).
        for block in blocks:
            replicate(block, mesh=dp_mesh, mp_policy=mp_policy)
        replicate(network, mesh=dp_mesh, mp_policy=mp_policy)
        return
    reshard = zero_stage == 3
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    # The root holds what is left (embedding, final norm, head); NOTE: not resharded after forward because
    # backward starts with it.
    fully_shard(network, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy)


@contextmanager
def gradient_sync_off(modules: list[nn.Module], keep_gathered: bool = False) -> Iterator[None]:
    """No gradient communication from the data-parallel units among ``modules`` (DDP and FSDP2) inside the context,
    for the micro-steps before the last of an accumulation window. ``keep_gathered`` (ZeRO-2): keep each unit's
    parameters gathered after backward too, since they are gathered once per step anyway."""
    from torch.distributed._composable.replicate import DDP
    from torch.distributed.fsdp import FSDPModule

    ddp = [m for m in modules if isinstance(m, DDP)]
    units = [m for m in modules if isinstance(m, FSDPModule)]

    def switch(sync: bool) -> None:
        for module in ddp:
            module.set_requires_gradient_sync(sync)
        for unit in units:
            unit.set_requires_gradient_sync(sync, recurse=False)
            if keep_gathered:
                unit.set_reshard_after_backward(sync, recurse=False)

    switch(False)
    try:
        yield
    finally:
        switch(True)


ELEMENTWISE_OPTIMIZERS = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)


class LocalShardOptimizer:
    """Runs an elementwise optimizer on plain local tensors: each parameter's shard on this rank, and with
    ZeRO-1 only this DP rank's slice of it.

    AdamW and its kind update every element on its own, so stepping a shard computes exactly what stepping
    the whole tensor would, without DTensor's per-operation dispatch (on small models that costs more than the
    arithmetic). The optimizer's parameters are swapped for views of the shards (no copy): a step updates the
    model in place. Around each step, `scatter_grads` hands the optimizer the matching views of the gradients
    and `gather_params` (ZeRO-1 only) replicates the updated slices over DP again, with a DTensor redistribute
    (an all-gather per parameter). Create it before the optimizer's first step.

    ZeRO-1 splits each replicated parameter along a tensor dim that tensor parallelism leaves whole, so the
    optimizer states are 1/D the size; `state_layout` gives their place in the global tensor for checkpoints.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, zero1: bool, dp_dim: str = "dp") -> None:
        if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
            raise TypeError(
                f"{type(optimizer).__name__} is not one of the elementwise optimizers "
                f"({', '.join(o.__name__ for o in ELEMENTWISE_OPTIMIZERS)}) that ZeRO-1 can shard; "
                "use zero_stage 0, 2 or 3"
            )
        if optimizer.state:
            raise RuntimeError("the optimizer's parameters must be swapped before its first step")
        self.zero1, self.dp_dim = zero1, dp_dim
        self.entries: list[_Entry] = []
        for group in optimizer.param_groups:
            entries = [self._entry(p) for p in group["params"]]
            self.entries += entries
            group["params"] = [e.view for e in entries]
        self._by_view = {id(e.view): e for e in self.entries}
        self._buckets = _buckets([e for e in self.entries if e.split is not None])

    def _entry(self, param: torch.Tensor) -> _Entry:
        if not isinstance(param, DTensor):
            return _Entry(param, param, None, None)
        placements, split = list(param.placements), None
        if self.zero1:
            mesh_dim = param.device_mesh.mesh_dim_names.index(self.dp_dim)
            if not isinstance(placements[mesh_dim], Replicate):
                raise TypeError(f"ZeRO-1 expects parameters replicated over {self.dp_dim!r}, got {param.placements}")
            taken = {p.dim for p in placements if isinstance(p, Shard)}
            dim = next((d for d in range(param.ndim) if d not in taken), None)
            if dim is None:
                raise ValueError(f"no dim of a {tuple(param.shape)} parameter is free for ZeRO-1 sharding")
            placements[mesh_dim], split = Shard(dim), (mesh_dim, dim)
        entry = _Entry(param, None, tuple(placements), split)
        entry.view = nn.Parameter(entry.local(param).detach(), requires_grad=param.requires_grad)
        return entry

    def scatter_grads(self) -> None:
        for e in self.entries:
            if e.view is not e.param:
                e.view.grad = None if e.param.grad is None else e.local(e.param.grad)

    @torch.no_grad()
    def gather_params(self) -> None:
        if self.zero1:
            for bucket in self._buckets:
                _all_gather_slices(bucket)
        for e in self.entries:
            if e.view is not e.param:
                # The model's gradients are what backward accumulates into; the step has consumed them.
                e.param.grad = e.view.grad = None

    def as_global(self, view: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """A state tensor of ``view`` (exp_avg, ...) as a DTensor placed in the parameter's global shape, sharing
        its storage; scalars (the step count) stay as they are. For checkpoints that any layout can read."""
        entry = self._by_view[id(view)]
        if entry.placements is None or state.shape != view.shape:
            return state
        param = entry.param
        return DTensor.from_local(
            state, param.device_mesh, entry.placements, run_check=False, shape=param.shape, stride=param.stride()
        )


class _Entry:
    """One parameter: the model's (DTensor) parameter and the plain view the optimizer steps."""

    def __init__(self, param: torch.Tensor, view: torch.Tensor | None, placements: Any, split: Any) -> None:
        self.param, self.view, self.placements, self.split = param, view, placements, split

    def slices(self) -> list[tuple[int, int]]:
        """(start, length) along the split dim of each DP rank's slice (torch.chunk's split, as DTensor's)."""
        mesh_dim, dim = self.split
        size, parts = self.param.to_local().shape[dim], self.param.device_mesh.size(mesh_dim)
        step = -(-size // parts)
        return [(min(r * step, size), max(0, min(step, size - r * step))) for r in range(parts)]

    def local(self, tensor: DTensor) -> torch.Tensor:
        """This rank's part of ``tensor`` (the parameter or its gradient) that the optimizer steps, as a view."""
        local = tensor.to_local()
        if self.split is None:
            return local
        mesh_dim, dim = self.split
        mesh = tensor.device_mesh
        return _rank_chunk(local, dim, mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))


BUCKET_ELEMENTS = 50_000_000  # one all-gather gathers at most this many elements per rank


def _buckets(entries: list[_Entry]) -> list[list[_Entry]]:
    """ZeRO-1 entries in groups gathered by one collective each: same process group and dtype, bounded size."""
    buckets: dict[tuple, list[list[_Entry]]] = {}
    for e in entries:
        key = (e.param.device_mesh.get_group(e.split[0]), e.view.dtype)
        groups = buckets.setdefault(key, [[]])
        if groups[-1] and sum(_slice_numel(x) for x in groups[-1]) + _slice_numel(e) > BUCKET_ELEMENTS:
            groups.append([])
        groups[-1].append(e)
    return [bucket for groups in buckets.values() for bucket in groups]


def _slice_numel(e: _Entry) -> int:
    """Elements of the largest DP slice of the entry's parameter (what each rank contributes, padded)."""
    local, dim = e.param.to_local(), e.split[1]
    return local.numel() // max(1, local.shape[dim]) * max(length for _, length in e.slices())


def _all_gather_slices(bucket: list[_Entry]) -> None:
    """Replicate the updated ZeRO-1 slices of a bucket of parameters over DP with one all-gather.

    Every rank packs its slices into one flat buffer (each padded to the largest slice), all ranks' buffers
    are gathered, and each slice is copied back into its place in the parameter.
    """
    mesh_dim = bucket[0].split[0]
    mesh = bucket[0].param.device_mesh
    group, ranks, me = mesh.get_group(mesh_dim), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    sizes = [_slice_numel(e) for e in bucket]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    send = bucket[0].view.new_zeros(sum(sizes))
    for e, offset in zip(bucket, offsets):
        send[offset : offset + e.view.numel()].copy_(e.view.reshape(-1))
    received = send.new_empty(ranks * sum(sizes))
    torch.distributed.all_gather_single(received, send, group=group)
    received = received.view(ranks, sum(sizes))
    for e, offset in zip(bucket, offsets):
        local, dim = e.param.to_local(), e.split[1]
        for rank, (start, length) in enumerate(e.slices()):
            if rank != me and length:
                target = local.narrow(dim, start, length)
                target.copy_(received[rank, offset : offset + target.numel()].view(target.shape))


def _rank_chunk(tensor: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """``torch.chunk``'s split of ``dim`` (the one DTensor's ``Shard`` uses, trailing parts may be empty)."""
    size = tensor.shape[dim]
    step = -(-size // parts)
    start = min(index * step, size)
    return tensor.narrow(dim, start, min(step, size - start))


def check_replicas_in_sync(module: nn.Module, dp_mesh: DeviceMesh, other_roots: tuple[nn.Module, ...] = ()) -> None:
    """Refuse, on every rank alike, parameters the data-parallel replicas would not keep in sync: ones outside any
    data-parallel unit (DDP, FSDP2), or replicated ones whose values differ between the replicas.

    A parameter sharded over the data-parallel dim (FSDP2's ZeRO) is in sync by construction. Collective over
    ``dp_mesh``: one all-gather of a checksum per replicated parameter. ``other_roots``: modules outside
    ``module`` that hold data-parallel units of its parameters (pipeline chunks).
    """
    from torch.distributed._composable.replicate import DDP
    from torch.distributed.fsdp import FSDPModule

    units = [m for root in (module, *other_roots) for m in root.modules() if isinstance(m, DDP | FSDPModule)]
    covered = {id(p) for unit in units for p in unit.parameters()}
    names = [name for name, p in module.named_parameters() if id(p) not in covered]
    if names:
        raise RuntimeError(
            f"{type(module).__name__} has parameters that nothing keeps in sync over the {dp_mesh.size()} "
            f"data-parallel replicas, e.g. {names[:4]}: each replica would train on its own. Apply data parallelism "
            "in `configure_model` (`fully_shard(module, mesh=self.device_mesh['data_parallel'])`, or `replicate`), "
            "or give the module lit3d's protocol (`model.blocks` and a `tensor_parallel_plan`) so the strategy does"
        )
    dim = dp_mesh.mesh_dim_names[0]
    replicated = {}
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            if not p.placements[p.device_mesh.mesh_dim_names.index(dim)].is_replicate():
                continue  # sharded over the replicas (FSDP2's Shard, or _StridedShard with TP): nothing to compare
            p = p.to_local()
        replicated[name] = p.detach()
    if not replicated:
        return
    sums = torch.stack([torch.stack((p.double().sum(), p.double().square().sum())) for p in replicated.values()])
    every = sums.new_empty(dp_mesh.size() * sums.shape[0], 2)
    torch.distributed.all_gather_single(every, sums, group=dp_mesh.get_group())
    every = every.view(dp_mesh.size(), *sums.shape)
    differ = [name for name, row in zip(replicated, (every - every[:1]).abs().amax(dim=(0, 2))) if row > 0]
    if differ:
        raise RuntimeError(
            f"the data-parallel replicas of {type(module).__name__} start from different weights, e.g. {differ[:4]}: "
            "seed every rank alike (`seed_everything`) or broadcast the weights in `configure_model`"
        )
