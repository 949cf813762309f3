"""The order in which a network is split: one function, called by the strategy and by `lit3d plan --verify`.

    pipeline stages → FP8 linears → tensor parallel → expert parallel → context parallel → activation checkpointing
    → compile → data parallel / ZeRO

Each step works on what the previous one left: tensor parallelism turns the stage's parameters into DTensors,
checkpointing and compile wrap the (already split) blocks, and data parallelism comes last so that FSDP2 shards
the DTensor shards over the ``dp`` mesh dimension and its units are the checkpointed, compiled blocks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.device_mesh import DeviceMesh

from lit3d.models.loop import starts_optimizer_step
from lit3d.models.moe import MoE
from lit3d.models.runner import ContextShare, ReplicaShare, Runner, WholeNetwork
from lit3d.parallel.schedules import SCHEDULES
from lit3d.parallel.settings import Parallelism
from lit3d.parallel.shares import share_weight
from lit3d.parallel.zero import ZeroPolicy
from lit3d.strategies.meshes import ParallelMeshes
from lit3d.strategies.optim.dtypes import ddp_runs, mixed_precision_policy
from lit3d.strategies.pipelining.chunks import split_into_stages
from lit3d.strategies.pipelining.step import Pipeline
from lit3d.strategies.split.context_parallel import apply_context_parallel
from lit3d.strategies.split.data_parallel import apply_data_parallel
from lit3d.strategies.split.float8 import apply_float8, cpu_matmul_line, emulates
from lit3d.strategies.split.recompute import apply_activation_checkpointing
from lit3d.strategies.split.tensor_parallel import apply_tensor_parallel, check_plan, keep_sequence_shards


def apply_expert_parallel(network: nn.Module, ep_mesh: DeviceMesh, group: object | None = None) -> None:
    """Split the experts of every MoE layer of ``network`` over ``ep_mesh``: each expert weight becomes a DTensor
    sharded along its expert dim (each rank holds a contiguous run of experts), and the layer dispatches its
    tokens over ``group`` (the same ranks; default: the mesh's group) (`lit3d.models.moe.dispatch`)."""
    from torch.distributed.tensor import DTensor, Shard

    for moe in (m for m in network.modules() if isinstance(m, MoE)):
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            rank, size = ep_mesh.get_local_rank(), ep_mesh.size()
            local = param.detach().chunk(size, dim=0)[rank]
            sharded = DTensor.from_local(
                local, ep_mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()
            )
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.grad_scale = 1 / ep_mesh.size()
        moe.ep_group = group or ep_mesh.get_group()


def apply_compile(blocks: list[nn.Module], compile: bool | str, checkpointed: bool) -> None:
    """``torch.compile`` each block in place (``compile``: True for inductor, or a backend's name)."""
    options = {} if compile is True else {"backend": compile}
    for block in blocks:
        # NOTE: a block with checkpoint hooks does not compile as a whole (recompute sees other metadata); its
        # sub-modules do.
        for part in block.children() if checkpointed else [block]:
            part.compile(**options)


def split_module(
    module: nn.Module,
    parallelism: Parallelism,
    meshes: ParallelMeshes,
    rank: int,
    microbatches: int,
    device: torch.device,
    precision_plugin: Any,
) -> tuple[Runner, Pipeline | None]:
    """Split ``module.model`` for ``rank`` (`parallelize_network`), give it its weights (from the seed and the
    parameter names, shard by shard), and return the runner of this rank's part (`lit3d.models.runner`) and the
    pipeline. ``precision_plugin``: Lightning's, whose ``precision`` this reads, and fp16's loss scaler at each step."""
    network, layout, precision = module.model, meshes.layout, precision_plugin.precision
    mp_policy = mixed_precision_policy(precision, parallelism.mixed_precision_reduce)
    ddp = ddp_runs(parallelism, layout, precision)
    if getattr(network, "_lit3d_split", False):
        raise RuntimeError(
            f"{type(module).__name__}.model was split by another Parallel3DStrategy; a new "
            "strategy needs a new model (load the weights from a checkpoint)"
        )
    network._lit3d_split = layout.world_size > 1  # 1x1x1 leaves it as it is
    plan = module.tensor_parallel_plan
    chunks, stage_ids = parallelize_network(network, plan, parallelism, meshes, rank, mp_policy=mp_policy, ddp=ddp)
    if parallelism.float8 and device.type == "cpu":
        rank_zero_info(cpu_matmul_line(parallelism.float8))
    if any(p.is_meta for p in network.parameters()):
        for chunk in chunks:  # NOTE: offloaded weights are made in host memory, where FSDP2 keeps them
            chunk.to_empty(device="cpu" if parallelism.offload else device)
            for owner in chunk.modules() if parallelism.offload else ():  # buffers (a router's bias): on the device
                for name, buffer in list(owner.named_buffers(recurse=False)):
                    setattr(owner, name, buffer.to(device))  # (a registered buffer keeps its persistence)
        network.tie_weights()
        network.reset_parameters()
    runner: Runner = WholeNetwork()
    pipeline = None
    shares = parallelism.data_parallel_shares  # uneven replicas: each one's objective weighted by its share
    weight = share_weight(shares, layout.data_rank(rank)) if shares is not None else 1.0
    if layout.pp > 1:
        runner = pipeline = Pipeline(
            chunks,
            stage_ids,
            layout.pp * parallelism.chunks_per_rank,
            meshes.world["pp"],
            parallelism.pipeline_schedule,
            microbatches,
            device,
            loss_parallel=layout.tp > 1,
            split_backward=not parallelism.activation_checkpointing,
            accumulate=lambda: module.trainer.accumulate_grad_batches,
            first_micro_step=lambda: starts_optimizer_step(module.trainer),
            grad_scaler=lambda: getattr(precision_plugin, "scaler", None),
            balance_weight=weight,
        )
    if layout.cp > 1:  # each rank's share of the batch's sequences
        runner = ContextShare(runner, layout.cp, layout.cp_rank(rank))
    if shares is not None:
        runner = ReplicaShare(runner, weight)
    return runner, pipeline


def move_the_rest(module: nn.Module, split: nn.Module, device: torch.device) -> None:
    """Move what ``module`` holds besides its ``split`` network to ``device``.

    NOTE: the split network already lives on this device, and moving DTensor parameters swaps them under the
    optimizer's views and the pipeline's stages."""
    for child in module.children():
        if child is not split:
            child.to(device)


def refuse_fsdp1(module: nn.Module) -> None:
    """A module wrapped in the legacy ``FullyShardedDataParallel`` (FSDP1): refused, as ModelParallelStrategy does."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise TypeError(
            "Found modules that are wrapped with `torch.distributed.fsdp.FullyShardedDataParallel` (FSDP1); "
            "Parallel3DStrategy, like ModelParallelStrategy, takes the FSDP2 API (`fully_shard`) in `configure_model`"
        )


def not_splittable(module: nn.Module) -> TypeError:
    """The error for a module that neither follows lit3d's protocol nor parallelises itself."""
    return TypeError(
        f"Parallel3DStrategy parallelises modules that have `model.blocks` and a `tensor_parallel_plan` (like "
        f"lit3d.GPT); {type(module).__name__} has neither, so override `configure_model` and parallelise it there "
        "with `self.device_mesh`"
    )


def prediction_depths(network: nn.Module) -> list[nn.Module]:
    """The multi-token-prediction depths a lit3d network holds (``mtp``: `lit3d.models.mtp`); none in another."""
    mtp = getattr(network, "mtp", None)
    return list(mtp.values()) if isinstance(mtp, nn.ModuleDict) else []


def follows_plan(module: nn.Module) -> bool:
    """Whether the strategy can split ``module`` itself: a ``model`` with ``blocks`` and a ``tensor_parallel_plan``."""
    network = getattr(module, "model", None)
    return hasattr(module, "tensor_parallel_plan") and isinstance(getattr(network, "blocks", None), nn.ModuleDict)


def parallelize_network(
    network: nn.Module,
    plan: dict[str, str],
    parallelism: Parallelism,
    meshes: ParallelMeshes,
    rank: int,
    *,
    mp_policy: object | None = None,
    ddp: bool | None = None,
) -> tuple[list[nn.Module], list[int]]:
    """Split ``network`` for ``rank`` in place, in the fixed order, without giving it weights (it may stay on
    the meta device, as `lit3d plan --verify` keeps it).

    Returns this rank's pipeline chunks (views of ``network``; ``[network]`` without pipeline parallelism) and
    their stage indices. ``mp_policy``: FSDP2's mixed precision (`lit3d.strategies.optim.dtypes`); ``ddp``: whether
    ZeRO-0 may be PyTorch's DDP (default: when the network is data parallel only).
    """
    layout, mesh, expert_mesh = meshes.layout, meshes.sharding, meshes.experts
    sequence_parallel, compile = parallelism.splits_sequence(layout), parallelism.compile
    activation_checkpointing = parallelism.activation_checkpointing
    check_plan(network, plan)
    chunks, stage_ids = [network], [0]
    if layout.pp > 1:
        placement = SCHEDULES[parallelism.pipeline_schedule].placement  # which chunks a rank holds: a loop, or a V
        p = layout.coordinate(rank).p
        chunks, stage_ids = split_into_stages(
            network, p, layout.pp, parallelism.chunks_per_rank, placement, parallelism.pipeline_stage_layers
        )
    if parallelism.float8:  # a module swap that keeps the names TP's plan and FSDP2 go by
        emulate = emulates(meshes.world.device_type)  # on CPU: torchao's emulation of the FP8 matmuls
        apply_float8(network, parallelism.float8, parallelism.float8_all_gather, emulate)
    if layout.tp > 1:
        apply_tensor_parallel(network, plan, mesh["tp"], sequence_parallel)
        if sequence_parallel and not activation_checkpointing and not compile:  # (recompute keeps less anyway)
            keep_sequence_shards(network, plan)
        if hasattr(network, "tie_weights"):
            network.tie_weights()  # TP distributed the shared tensor once per module
    if expert_mesh is not None:
        apply_expert_parallel(network, expert_mesh["ep"], meshes.ep_group)
    if layout.cp > 1:
        apply_context_parallel(network, meshes.cp_group, layout.cp, layout.cp_rank(rank))
    # (a lit3d network's multi-token-prediction depths hold a block each: recomputed and compiled as the others)
    blocks = list(network.blocks.values()) + [depth.block for depth in prediction_depths(network)]
    if activation_checkpointing:
        apply_activation_checkpointing(blocks, activation_checkpointing)
    if compile:
        apply_compile(blocks, compile, checkpointed=bool(activation_checkpointing))
    if layout.replicas > 1 or parallelism.offload:  # dp x cp ranks hold the same weights (or FSDP2 offloads them)
        for chunk in chunks:  # each pipeline chunk is a data-parallel root of its own
            apply_data_parallel(
                chunk,
                list(chunk.blocks.values()) + prediction_depths(chunk),  # (a unit per depth too)
                meshes.zero_mesh,
                ZeroPolicy.of(parallelism, layout),
                mp_policy,
                data_parallel_only=layout.tp == layout.pp == 1 and layout.ep == 1 if ddp is None else ddp,
                expert_mesh=expert_mesh,
                offload=parallelism.offload,
            )
    return chunks, stage_ids
