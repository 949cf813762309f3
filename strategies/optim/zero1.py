"""ZeRO-1 by the ZeRO paper (P_os): the optimizer steps each rank's slice of every parameter, on plain local
tensors; the gradients are reduce-scattered to it in buckets and the updated slices all-gathered back (DDP's
bytes). Under bf16-mixed the parameters are bf16 and the optimizer steps fp32 master copies of the slices
(Megatron's distributed optimizer). Also the local-shard stepping every DTensor-sharded layout uses
(`LocalShardOptimizer` without a mesh).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lit3d.models.muon import Muon, laid_out_as, whole_matrix
from lit3d.strategies.optim.zero1_buckets import buckets
from lit3d.strategies.optim.zero1_params import SlicedParam, rank_chunk

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
    ``reduce_dtype`` (e.g. bf16) is the dtype the gradients travel in; the average lands in the optimizer's.

    ``param_dtype`` (ZeRO-1 under bf16-mixed: bf16) makes it Megatron's distributed optimizer: the parameters are
    cast to it (the values autocast would compute with anyway), the optimizer steps an fp32 master copy of each
    slice, backward's gradients are summed in fp32 across backwards (as fp32 parameters would sum them) and the
    updated masters all-gathered in ``param_dtype``: ``2 + (4 + 12) / D`` bytes per parameter, not ``4 + (4 + 8) /
    D``. Checkpoints hold the masters as the weights (`master_weights`); ``masters``: those of an earlier setup.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        zero1_mesh: DeviceMesh | None = None,
        reduce_dtype: torch.dtype | None = None,
        module: nn.Module | None = None,
        expert_mesh: DeviceMesh | None = None,
        param_dtype: torch.dtype | None = None,
        masters: dict[int, torch.Tensor] | None = None,
    ) -> None:
        if zero1_mesh is not None and not isinstance(optimizer, (*ELEMENTWISE_OPTIMIZERS, Muon)):
            raise TypeError(
                f"{type(optimizer).__name__} is not one of the optimizers "
                f"({', '.join(o.__name__ for o in (*ELEMENTWISE_OPTIMIZERS, Muon))}) that ZeRO-1 can shard; "
                "use zero_stage 0, 2 or 3"
            )
        if optimizer.state:
            raise RuntimeError("the optimizer's parameters must be swapped before its first step")
        if param_dtype is not None and zero1_mesh is None:
            raise ValueError("master weights (param_dtype) are ZeRO-1's: give its mesh")
        self.mesh, self.reduce_dtype, self.expert_mesh = zero1_mesh, reduce_dtype, expert_mesh
        names = zero1_mesh.mesh_dim_names if zero1_mesh is not None else ()
        self.dp_dim = next((dim for dim in ("dp_shard", "dp_cp") if dim in names), "dp")  # what slices split over
        self.replicated = ("dp_replicate",) if "dp_replicate" in names else ()  # HSDP: shard groups, replicas
        self.param_dtype, self._masters = param_dtype, masters or {}
        self.entries: list[SlicedParam] = []
        for group in optimizer.param_groups:
            entries = [self._entry(p) for p in group["params"]]
            self.entries += entries
            group["params"] = [e.view for e in entries]
        if param_dtype is not None:
            for e in self.entries:
                _hold_in(e.param, param_dtype)
        self._by_view = {id(e.view): e for e in self.entries}
        if zero1_mesh is not None and isinstance(optimizer, Muon):  # (how its slices are made whole, and cut back)
            optimizer.lay_out(self.whole_update, self.own_part, self.part_of, self.placed_update)
        sliced = [e for e in self.entries if e.dim is not None]
        if module is not None:  # buckets in the order backward finishes the gradients: the module's last first
            index = {id(p): i for i, p in enumerate(module.parameters())}
            sliced.sort(key=lambda e: -index.get(id(e.param), -1))
        self._buckets = buckets(sliced)
        # Each gradient goes to its bucket's rows as soon as backward has finished it; under master weights, those of
        # the parameters ZeRO-1 does not slice are set aside in fp32.
        self._hooks = [
            e.param.register_post_accumulate_grad_hook(partial(self._grad_ready, i, e))
            for i, bucket in enumerate(self._buckets)
            for e in bucket.entries
            if e.param.requires_grad
        ]
        if param_dtype is not None:
            aside = [e for e in self.entries if e.dim is None and e.param.requires_grad]
            self._hooks += [e.param.register_post_accumulate_grad_hook(e.set_grad_aside) for e in aside]
        self._launched = -1  # buckets up to this index have started their reduce-scatter this step
        self._overlapping = False  # inside `overlap`

    def _entry(self, param: torch.Tensor) -> SlicedParam:
        if self.mesh is None:
            if not isinstance(param, DTensor):
                return SlicedParam(param, param)
            entry = SlicedParam(param, None, param.device_mesh, tuple(param.placements))
        elif isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == ("ep",):
            entry = self._expert_entry(param)
        else:
            tp = tuple(param.placements) if isinstance(param, DTensor) else ()
            if isinstance(param, DTensor) and param.device_mesh.mesh_dim_names != ("tp",):
                raise TypeError(f"ZeRO-1 expects plain or tensor-parallel parameters, got {param.placements}")
            taken = {p.dim for p in tp if isinstance(p, Shard)}
            dim = next((d for d in range(param.ndim) if d not in taken), 0)
            mesh = self.mesh[(*self.replicated, self.dp_dim, *(("tp",) if tp else ()))]
            # A column-parallel linear's bias has no dim TP leaves whole: each TP rank's part is sliced over DP,
            # which DTensor places as a strided shard (FSDP2 places such tensors the same way).
            over_dp = _StridedShard(dim, split_factor=mesh["tp"].size()) if dim in taken else Shard(dim)
            placements = (*(Replicate() for _ in self.replicated), over_dp, *tp)
            entry = SlicedParam(param, None, mesh, placements, dim, dp_dim=self.dp_dim)
            entry.tp_sharded = bool(taken)
        view = entry.local(param).detach()
        if self.param_dtype is not None:  # the fp32 master weights of this rank's part
            view = self._masters.get(id(param), view).to(torch.float32, copy=True)
        entry.view = nn.Parameter(view, requires_grad=param.requires_grad)
        return entry

    def whole_update(self, view: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """Muon under ZeRO-1: ``update`` (of ``view``, this rank's slice) gathered whole over the ranks that slice or
        split it; a stack of experts keeps its split along the experts (each expert is its own matrix)."""
        entry = self._by_view[id(view)]
        kept = _kept(entry, view)
        if entry.placements is None or all(kept):
            return update
        placed = self.as_global(view, update)
        if not any(kept):
            return whole_matrix(placed, placed)
        kept_placements = [p if k else Replicate() for p, k in zip(entry.placements, kept)]
        return placed.redistribute(placements=kept_placements).to_local()

    def own_part(self, view: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """Muon under ZeRO-1: this rank's slice of ``whole`` (`whole_update`'s), cut with no communication."""
        entry = self._by_view[id(view)]
        if entry.placements is None:
            return whole
        for i, (placement, kept) in enumerate(zip(entry.placements, _kept(entry, view))):
            if placement.is_shard() and not kept:
                whole = rank_chunk(whole, placement.dim, entry.mesh.size(i), entry.mesh.get_local_rank(i))
        return whole

    def placed_update(self, view: torch.Tensor, update: torch.Tensor) -> DTensor | None:
        """Muon under ZeRO-1: ``update`` (of ``view``, this rank's slice) as a DTensor of the whole matrix (its
        storage), or None where the parameter is not sliced."""
        placed = self.as_global(view, update)
        return placed if isinstance(placed, DTensor) else None

    def part_of(self, view: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Muon under ZeRO-1: ``rows`` (one factor per row of the parameter's whole tensor) laid out as ``view``, this
        rank's slice of it."""
        entry = self._by_view[id(view)]
        return entry.local(laid_out_as(entry.param, rows))

    def _expert_entry(self, param: DTensor) -> SlicedParam:
        """An MoE expert weight, split over the EP ranks (dim 0), sliced and averaged over the ``edp`` ranks that
        hold the same experts (with a single such group, nothing to average). Its gradient comes scaled already
        (`lit3d.models.moe.Experts.grad_scale`)."""
        if self.expert_mesh["edp"].size() == 1:
            return SlicedParam(param, None, param.device_mesh, tuple(param.placements), dp_dim="edp")
        mesh = self.expert_mesh["edp", "ep"]
        return SlicedParam(param, None, mesh, (Shard(1), *param.placements), 1, dp_dim="edp")

    def remove_hooks(self) -> None:
        """Its backward hooks off the parameters, before another setup of them replaces it (a second fit)."""
        for hook in self._hooks:
            hook.remove()

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
        for bucket in self._buckets:
            bucket.ready = 0
        self._overlapping = True
        try:
            yield
        finally:
            self._overlapping = False

    @torch.no_grad()
    def _grad_ready(self, index: int, entry: SlicedParam, param: torch.Tensor) -> None:
        self._buckets[index].add_grad(entry)
        if not self._overlapping:  # a micro-step before the last, or a pipeline's micro-batch: the rows sum it
            return
        self._buckets[index].ready += 1
        while self._launched + 1 < len(self._buckets):
            bucket = self._buckets[self._launched + 1]
            if bucket.ready < len(bucket.entries):
                break
            self._launch_next()

    def _launch_next(self) -> None:
        """Start the next bucket's reduce-scatter, then finish the one before it. NOTE: so at most two buckets'
        rows are alive at once, one in flight and one filling, not a whole gradient (Megatron's main_grad)."""
        self._launched += 1
        self._buckets[self._launched].start_reduce_scatter(self.reduce_dtype)
        if self._launched > 0:
            self._buckets[self._launched - 1].finish_reduce_scatter()

    @torch.no_grad()
    def scatter_grads(self) -> None:
        """Hand the optimizer its views of the gradients; with ZeRO-1, their DP averages (a reduce-scatter)."""
        while self._launched + 1 < len(self._buckets):
            self._launch_next()
        if self._buckets:
            self._buckets[-1].finish_reduce_scatter()
        self._launched = -1
        for e in self.entries:
            if e.view is not e.param and e.dim is None:
                grad = e.take_grad() if self.param_dtype is not None else e.param.grad
                e.view.grad = None if grad is None else e.local(grad).to(e.view.dtype)

    @torch.no_grad()
    def gather_params(self) -> None:
        """The updated slices into every replica's parameters (with master weights: cast to ``param_dtype``)."""
        for bucket in self._buckets:
            bucket.all_gather()
        for e in self.entries:
            if e.view is not e.param:
                if self.param_dtype is not None:  # this rank's own part: from its master weights
                    e.local(e.param).copy_(e.view)
                # The model's gradients are what backward accumulates into; the step has consumed them.
                e.param.grad = e.view.grad = e.grad_aside = None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, pipeline_group: Any = None) -> torch.Tensor:
        """ZeRO-1: scale the gradient slices so the whole model's gradient norm is at most ``max_norm``.

        The slices are disjoint over DP and TP-sharded tensors over TP, while a tensor TP replicates is counted on
        the first TP rank only; so one sum of squares per rank, summed over DP, TP and the pipeline, is the norm.
        (Plain tensors: DTensor's dispatch would cost more than the arithmetic.)
        """
        mesh, grads = self.mesh, [e.view.grad for e in self.entries if e.view.grad is not None]
        first_tp = "tp" not in mesh.mesh_dim_names or mesh["tp"].get_local_rank() == 0
        counted = [e for e in self.entries if e.view.grad is not None and (first_tp or e.tp_sharded)]
        # HSDP: the shard groups hold the same slices (counted 1/R on each) but MoE experts' own (counted whole)
        replicas = mesh["dp_replicate"].size() if self.replicated else 1
        squares = (e.view.grad.float().square().sum() / (1 if e.dp_dim == "edp" else replicas) for e in counted)
        squared = sum(squares, torch.zeros((), device=grads[0].device))
        for dim in (*self.replicated, self.dp_dim, "tp", "pp"):
            group = pipeline_group if dim == "pp" else mesh[dim].get_group() if dim in mesh.mesh_dim_names else None
            if group is not None and torch.distributed.get_world_size(group) > 1:
                torch.distributed.all_reduce(squared, group=group)
        norm = squared.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return norm

    def master_weights(self) -> dict[int, torch.Tensor]:
        """With ``param_dtype``: each parameter's fp32 master weights, this rank's part placed in the parameter's
        global shape (`as_global`), by id of the parameter. Checkpoints hold these as the weights, so a resume is
        exact and any layout reads the fp32 values; after loading into them, `gather_params` refreshes the model."""
        if self.param_dtype is None:
            return {}
        return {id(e.param): self.as_global(e.view, e.view) for e in self.entries}

    def as_global(self, view: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """A state tensor of ``view`` (exp_avg, ...) as a DTensor placed in the parameter's global shape, sharing
        its storage; scalars (the step count) stay as they are. For checkpoints that any layout can read."""
        entry = self._by_view[id(view)]
        if entry.placements is None or state.shape != view.shape:
            return state
        shape = entry.param.shape
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(state, entry.mesh, entry.placements, run_check=False, shape=shape, stride=stride)


def _kept(entry: SlicedParam, view: torch.Tensor) -> list[bool]:
    """Which of ``entry``'s placements Muon's gather keeps: a stack of experts' split along its experts (dim 0)."""
    return [view.ndim == 3 and p.is_shard() and p.dim == 0 for p in entry.placements or ()]


def _hold_in(param: torch.Tensor, dtype: torch.dtype) -> None:
    """Cast ``param`` in place, the object modules and ties hold (NOTE: as `nn.Module.to` casts a DTensor)."""
    if param.dtype != dtype:
        torch.utils.swap_tensors(param, nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad))
