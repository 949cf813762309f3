"""The order in which a network is split: one function, called by the strategy and by `lit3d plan --verify`.

    pipeline stages → tensor parallel → expert parallel → context parallel → activation checkpointing → compile
    → data parallel / ZeRO

Each step works on what the previous one left: tensor parallelism turns the stage's parameters into DTensors,
checkpointing and compile wrap the (already split) blocks, and data parallelism comes last so that FSDP2 shards
the DTensor shards over the ``dp`` mesh dimension and its units are the checkpointed, compiled blocks.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from lit3d.parallel.layout import Layout
from lit3d.parallel.schedules import SCHEDULES
from lit3d.strategies.context_parallel import apply_context_parallel
from lit3d.strategies.recompute import apply_activation_checkpointing
from lit3d.strategies.stages import split_into_stages
from lit3d.strategies.tensor_parallel import apply_tensor_parallel, check_plan, keep_sequence_shards
from lit3d.strategies.zero import apply_data_parallel


def apply_expert_parallel(network: nn.Module, ep_mesh: DeviceMesh, group: object | None = None) -> None:
    """Split the experts of every MoE layer of ``network`` over ``ep_mesh``: each expert weight becomes a DTensor
    sharded along its expert dim (each rank holds a contiguous run of experts), and the layer dispatches its
    tokens over ``group`` (the same ranks; default: the mesh's group) (`lit3d.moe.dispatch`)."""
    from torch.distributed.tensor import DTensor, Shard

    from lit3d.moe import MoE

    for moe in (m for m in network.modules() if isinstance(m, MoE)):
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            rank, size = ep_mesh.get_local_rank(), ep_mesh.size()
            local = param.detach().chunk(size, dim=0)[rank]
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=param.shape,
                                         stride=param.stride())  # fmt: skip
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.grad_scale = 1 / ep_mesh.size()
        moe.ep_group = group or ep_mesh.get_group()


def follows_plan(module: nn.Module) -> bool:
    """Whether the strategy can split ``module`` itself: a ``model`` with ``blocks`` and a ``tensor_parallel_plan``."""
    network = getattr(module, "model", None)
    return hasattr(module, "tensor_parallel_plan") and isinstance(getattr(network, "blocks", None), nn.ModuleDict)


def parallelize_network(
    network: nn.Module,
    plan: dict[str, str],
    layout: Layout,
    mesh: DeviceMesh,
    rank: int,
    *,
    zero_stage: int,
    sequence_parallel: bool = False,
    virtual_pipeline_size: int = 1,
    pipeline_schedule: str = "1f1b",
    activation_checkpointing: bool | str = False,
    compile: bool | str = False,
    mp_policy: object | None = None,
    ddp: bool | None = None,
    expert_mesh: DeviceMesh | None = None,
    ep_group: object | None = None,
    cp_group: object | None = None,
) -> tuple[list[nn.Module], list[int]]:
    """Split ``network`` for ``rank`` in place, in the fixed order, without giving it weights (it may stay on
    the meta device, as `lit3d plan --verify` keeps it).

    Returns this rank's pipeline chunks (views of ``network``; ``[network]`` without pipeline parallelism) and
    their stage indices. ``mesh``: the ``(pp, dp, tp)`` mesh the weights are split over (its ``dp``: the ``dp × cp``
    replicas); ``mp_policy``: FSDP2's mixed precision (`lit3d.strategies.precision`); ``ddp``: whether ZeRO-0
    may be PyTorch's DDP (default: when the network is data parallel only); ``cp_group``: the ring of this rank's
    context-parallel layers (with ``layout.cp > 1``).
    """
    check_plan(network, plan)
    chunks, stage_ids = [network], [0]
    if layout.pp > 1:
        placement = SCHEDULES[pipeline_schedule].placement  # which chunks a rank holds: a loop, or a V
        p = layout.coordinate(rank).p
        chunks, stage_ids = split_into_stages(network, p, layout.pp, virtual_pipeline_size, placement)
    if layout.tp > 1:
        apply_tensor_parallel(network, plan, mesh["tp"], sequence_parallel)
        if sequence_parallel and not activation_checkpointing and not compile:  # (recompute keeps less anyway)
            keep_sequence_shards(network, plan)
        if hasattr(network, "tie_weights"):
            network.tie_weights()  # TP distributed the shared tensor once per module
    if expert_mesh is not None:
        apply_expert_parallel(network, expert_mesh["ep"], ep_group)
    if layout.cp > 1:
        apply_context_parallel(network, cp_group, layout.cp, layout.cp_rank(rank))
    blocks = list(network.blocks.values())
    if activation_checkpointing:
        apply_activation_checkpointing(blocks, activation_checkpointing)
    if compile:
        options = {} if compile is True else {"backend": compile}
        for block in blocks:
            # NOTE: a block with checkpoint hooks does not compile as a whole (recompute sees other metadata);
            # its sub-modules do.
            for part in block.children() if activation_checkpointing else [block]:
                part.compile(**options)
    if layout.replicas > 1:  # dp x cp ranks hold the same weights
        for chunk in chunks:  # each pipeline chunk is a data-parallel root of its own
            apply_data_parallel(
                chunk,
                list(chunk.blocks.values()),
                mesh["dp"],
                zero_stage,
                mp_policy,
                data_parallel_only=layout.tp == layout.pp == 1 and layout.ep == 1 if ddp is None else ddp,
                expert_mesh=expert_mesh,
            )
    return chunks, stage_ids
