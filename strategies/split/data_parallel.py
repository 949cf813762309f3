"""Data parallelism with ZeRO sharding over the DP mesh dimension, from PyTorch's FSDP2 building blocks.

What each stage shards and sends is `lit3d.parallel.zero.ZeroPolicy`'s (its table); here it is built.

ZeRO-0 on a network that is data parallel only is PyTorch's DDP (its composable ``replicate``): gradients go out
in buckets of about 25 MB, all-reduced in the background while backward goes on, as Lightning's ``ddp`` does.
DDP takes neither DTensor parameters nor a pipeline schedule's micro-batches, so with TP or PP, ZeRO-0 is FSDP2's
``replicate``: one all-reduce per block, issued in order (it overlaps through CUDA streams, not on CPU).

Stage 1 sends what DDP sends (the ZeRO paper's P_os): after backward, one reduce-scatter per bucket of gradients
and, after the step, one all-gather of the updated slices, 2·Ψ·(D−1)/D in all; nothing moves on the micro-steps of
an accumulation window (or of a pipeline schedule), since no wrapper syncs during backward. Under bf16-mixed its
parameters are bf16 and the fp32 master weights live in the optimizer's slices, so the all-gather moves bf16.

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
from torch.distributed.tensor import DTensor

from lit3d.models.moe import MoE
from lit3d.parallel.layout import LIGHTNING_DIM_NAMES
from lit3d.parallel.zero import ZeroPolicy
from lit3d.strategies.torch_compat import all_gather_single, ddp_no_buffer_sync


def apply_data_parallel(
    network: nn.Module,
    blocks: list[nn.Module],
    dp_mesh: DeviceMesh,
    zero: ZeroPolicy,
    mp_policy: Any = None,
    *,
    data_parallel_only: bool = False,
    expert_mesh: DeviceMesh | None = None,
    offload: bool = False,
) -> None:
    """Make ``network`` data parallel over ``dp_mesh`` in place; each of ``blocks`` is one communication unit.

    ``data_parallel_only``: the network is neither tensor- nor pipeline-parallel, so ZeRO-0 can be PyTorch's DDP.
    ``expert_mesh``: with expert parallelism, MoE experts are data parallel over its ``edp`` dim instead
    (`_experts_data_parallel`). ``offload`` (ZeRO-3): FSDP2 keeps the shards, their gradients and the optimizer's
    states in host memory.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if zero.all_reduces and data_parallel_only:
        from torch.distributed._composable.replicate import replicate

        # NOTE: no broadcast at the first forward (every rank initialises the same weights from the same seed),
        # none per forward (the only buffers, the rotary tables, are computed, not learnt), and gradients are
        # views of DDP's buckets rather than copies of them.
        replicate(
            network,
            process_group=dp_mesh.get_group(),
            init_sync=False,
            gradient_as_bucket_view=True,
            **ddp_no_buffer_sync(),
        )
        return
    if zero.stage == 1:  # `LocalShardOptimizer` syncs the gradients at the step; nothing to wrap
        network._lit3d_zero1 = True
        return
    mp_policy = mp_policy or MixedPrecisionPolicy()
    offload_policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    ignored = _experts_data_parallel(network, expert_mesh, zero, mp_policy, offload_policy)
    if zero.all_reduces:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        # One gradient all-reduce per block, issued as soon as backward is done with it (overlaps the rest).
        for block in blocks:
            replicate(block, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=ignored)
        replicate(network, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=ignored)
        return
    reshard = zero.reshards_after_forward
    policies = dict(mp_policy=mp_policy, offload_policy=offload_policy, ignored_params=ignored)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, **policies)
    # The root holds what is left (embedding, final norm, head); NOTE: not resharded after forward because
    # backward starts with it.
    fully_shard(network, mesh=dp_mesh, reshard_after_forward=False, **policies)


def _experts_data_parallel(
    network: nn.Module, expert_mesh: DeviceMesh | None, zero: ZeroPolicy, mp_policy: Any, offload_policy: Any = None
) -> set[nn.Parameter] | None:
    """Expert parallelism under ZeRO-0/2/3: each MoE layer's experts become an FSDP2 unit (ZeRO-0: ``replicate``)
    of their own over the ranks that hold the same experts (``edp``); with a single such group there is nothing to
    sync, and the experts are left out of the DP units (returned, to ignore). (Their gradients come scaled for
    this: `lit3d.models.moe.Experts.grad_scale`.)"""
    from torch.distributed.fsdp import fully_shard

    experts = [m.experts for m in network.modules() if isinstance(m, MoE) and m.ep_group is not None]
    if expert_mesh is None or not experts:
        return None
    edp = expert_mesh["edp"]
    if edp.size() == 1:
        return {p for e in experts for p in e.parameters()}
    for unit in experts:
        if zero.all_reduces:
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(unit, mesh=edp, mp_policy=mp_policy)
        else:
            fully_shard(
                unit,
                mesh=edp,
                reshard_after_forward=zero.reshards_after_forward,
                mp_policy=mp_policy,
                offload_policy=offload_policy,
            )
    return None


def accumulation_sync(modules: list[nn.Module], zero: ZeroPolicy) -> Any:
    """What the micro-steps of an accumulation window but the last communicate (`gradient_sync_off`): nothing under
    DDP (ZeRO-0); at ZeRO-2/3 a reduce-scatter per micro-step, so the gradients accumulate as shards, unless
    ``accumulate_unsharded``; ZeRO-2 keeps its parameters gathered from one micro-step to the next."""
    return gradient_sync_off(
        modules,
        keep_gathered=zero.keeps_gathered_across_micro_steps,
        sharded=zero.reduces_every_micro_step,
        hybrid=zero.hybrid,
    )


@contextmanager
def gradient_sync_off(
    modules: list[nn.Module], keep_gathered: bool = False, sharded: bool = True, hybrid: bool = False
) -> Iterator[None]:
    """Inside the context, for the micro-steps before the last of an accumulation window: no gradient communication
    from the DDP units among ``modules``; the FSDP2 units reduce-scatter as usual when ``sharded`` (their gradients
    accumulate as shards: 1/dp of them on each rank), else hold them unsharded until the last micro-step. With
    HSDP's shard groups (``hybrid``) the groups all-reduce their shards at the last micro-step only.
    ``keep_gathered`` (ZeRO-2): keep each FSDP2 unit's parameters gathered after backward, since ZeRO-2 gathers them
    once per step."""
    from torch.distributed._composable.replicate import DDP
    from torch.distributed.fsdp import FSDPModule

    ddp = [m for m in modules if isinstance(m, DDP)]
    units = [m for m in modules if isinstance(m, FSDPModule)]

    def switch(sync: bool) -> None:
        for module in ddp:
            module.set_requires_gradient_sync(sync)
        for unit in units:
            if not sharded:
                unit.set_requires_gradient_sync(sync, recurse=False)
            elif hybrid:
                unit.set_requires_all_reduce(sync, recurse=False)
            if keep_gathered:
                unit.set_reshard_after_backward(sync, recurse=False)

    switch(False)
    try:
        yield
    finally:
        switch(True)


def check_replicas_in_sync(
    module: nn.Module, dp_mesh: DeviceMesh, other_roots: tuple[nn.Module, ...] = ()
) -> list[str]:
    """Refuse, on every rank alike, parameters the data-parallel replicas would not keep in sync: trainable ones
    outside any data-parallel unit (DDP, FSDP2) that nothing else reduces, or replicated ones whose values differ
    between the replicas. Returns the names of those a module synchronises itself (a gradient hook of its own), which
    `replicas_apart` checks again after the first optimizer step.

    A parameter sharded over the data-parallel dim (FSDP2's ZeRO) is in sync by construction; a frozen one needs
    only to start alike. Collective over ``dp_mesh``: one all-gather of a checksum per replicated parameter.
    ``other_roots``: modules outside ``module`` that hold data-parallel units of its parameters (pipeline chunks).
    """
    from torch.distributed._composable.replicate import DDP
    from torch.distributed.fsdp import FSDPModule

    units = [
        m
        for root in (module, *other_roots)
        for m in root.modules()
        if isinstance(m, DDP | FSDPModule) or getattr(m, "_lit3d_zero1", False)
    ]
    covered = {id(p) for unit in units for p in unit.parameters()}
    alone = [(name, p) for name, p in module.named_parameters() if id(p) not in covered and p.requires_grad]
    own_sync = [name for name, p in alone if _has_grad_hooks(p)]
    names = [name for name, p in alone if name not in own_sync]
    if names:
        raise RuntimeError(
            f"{type(module).__name__} has parameters that nothing keeps in sync over the {dp_mesh.size()} "
            f"data-parallel replicas, e.g. {names[:4]}: each replica would train on its own. Apply data parallelism "
            "in `configure_model` (`fully_shard(module, mesh=self.device_mesh['data_parallel'])`, or `replicate`), "
            "or give the module lit3d's protocol (`model.blocks` and a `tensor_parallel_plan`) so the strategy does; "
            "frozen parameters, and ones whose gradient hooks reduce them, are accepted"
        )
    differ = replicas_apart(module, dp_mesh)
    if differ:
        raise RuntimeError(
            f"the data-parallel replicas of {type(module).__name__} start from different weights, e.g. {differ[:4]}: "
            "seed every rank alike (`seed_everything`) or broadcast the weights in `configure_model`"
        )
    return own_sync


def replicas_apart(module: nn.Module, dp_mesh: DeviceMesh, only: list[str] | None = None) -> list[str]:
    """Names of the replicated parameters (``only`` these, if given) whose values differ between the data-parallel
    replicas. Collective over ``dp_mesh``."""
    dim = dp_mesh.mesh_dim_names[0]
    dims = {dim, "dp_shard", *(long for long, short in LIGHTNING_DIM_NAMES.items() if short == dim)}  # (a module's own)
    replicated = {}
    for name, p in module.named_parameters():
        if only is not None and name not in only:
            continue
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            sharded = any(n in dims and not p.placements[i].is_replicate() for i, n in enumerate(names))
            if sharded or "ep" in names:
                continue  # sharded over the replicas (FSDP2's Shard, _StridedShard with TP, MoE experts)
            p = p.to_local()
        replicated[name] = p.detach()
    if not replicated:
        return []
    sums = torch.stack([torch.stack((p.double().sum(), p.double().square().sum())) for p in replicated.values()])
    every = sums.new_empty(dp_mesh.size() * sums.shape[0], 2)
    all_gather_single(every, sums, group=dp_mesh.get_group())
    every = every.view(dp_mesh.size(), *sums.shape)
    return [name for name, row in zip(replicated, (every - every[:1]).abs().amax(dim=(0, 2))) if row > 0]


class SyncedByModule:
    """Parameters a module keeps in sync over the replicas itself (`check_replicas_in_sync`): still alike after each
    of the first two optimizer steps, or the run stops, naming them (AdamW's first step moves every replica by the
    learning rate whatever its gradient: the second tells)."""

    def __init__(self, names: list[str], module: nn.Module, dp_mesh: DeviceMesh) -> None:
        self.names, self.module, self.dp_mesh, self.steps = names, module, dp_mesh, 0

    @classmethod
    def check(cls, module: nn.Module, dp_mesh: DeviceMesh, other_roots: tuple[nn.Module, ...] = ()) -> Any:
        """`check_replicas_in_sync` (collective), and what is left to check after the first steps, or None."""
        names = check_replicas_in_sync(module, dp_mesh, other_roots)
        return cls(names, module, dp_mesh) if names else None

    def after_step(self) -> None:
        """Collective over the replicas, for the first two steps; nothing afterwards."""
        if self.steps >= 2:
            return
        self.steps += 1
        apart = replicas_apart(self.module, self.dp_mesh, self.names)
        if apart:
            raise RuntimeError(
                f"the data-parallel replicas of {apart[:4]} differ after optimizer step {self.steps}: the module's own "
                "gradient hooks on them do not keep them in sync; apply data parallelism to them instead"
            )


def _has_grad_hooks(param: torch.Tensor) -> bool:
    """Whether a module hooked the parameter's gradient itself (to reduce it over the replicas, presumably)."""
    return bool(getattr(param, "_post_accumulate_grad_hooks", None) or getattr(param, "_backward_hooks", None))
