"""`OptimizerSteps`: how each optimizer of a split model steps (the strategy's ``optimizer_step`` and gradient
clipping call it).

An optimizer whose parameters are ZeRO-1 slices or tensor-parallel shards steps on its local shards
(`lit3d.strategies.optim.zero1.LocalShardOptimizer`): with ZeRO-1 the gradients are reduce-scattered before the step
(under bf16-mixed onto fp32 master weights) and the updated slices all-gathered after it. Gradient clipping uses the
norm over every shard and stage. DiLoCo's outer step follows the inner one (`lit3d.strategies.optim.diloco`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn as nn

from lit3d.parallel.settings import Parallelism
from lit3d.parallel.zero import ZeroPolicy
from lit3d.strategies.meshes import ParallelMeshes
from lit3d.strategies.optim.diloco import OuterLoop, build_outer_loop
from lit3d.strategies.optim.dtypes import reduce_dtype
from lit3d.strategies.optim.grad_norm import clip_grad_norm_
from lit3d.strategies.optim.zero1 import ELEMENTWISE_OPTIMIZERS, LocalShardOptimizer
from lit3d.strategies.runtime.replica_groups import ReplicaGroups
from lit3d.strategies.split.float8 import precompute_scales


class OptimizerSteps:
    """The optimizers of one fit, each with the way it steps.

    Args:
        parallelism: The run's settings.
        meshes: The run's meshes and groups.
        precision: Lightning's precision setting (``"bf16-mixed"``, ...).
        zero1: Whether ZeRO-1 shards the optimizer states (the strategy applied data parallelism itself).
        split: Whether the strategy split the module (a module that parallelises itself keeps its optimizers as
            they are, with their DTensor parameters, as under Lightning's ``ModelParallelStrategy``).
    """

    def __init__(
        self, parallelism: Parallelism, meshes: ParallelMeshes, precision: str, zero1: bool, split: bool = True
    ) -> None:
        self.parallelism, self.meshes, self.precision, self.zero1 = parallelism, meshes, precision, zero1
        self.split = split
        self.local: dict[int, LocalShardOptimizer] = {}  # by id of the optimizer
        self.outer_loop: OuterLoop | None = None
        self.module: nn.Module | None = None
        self.replica_groups: ReplicaGroups | None = None  # set by the strategy once the groups have met

    def build(self, optimizers: list[torch.optim.Optimizer], module: nn.Module, earlier: OptimizerSteps | None) -> None:
        """Wrap each optimizer that steps on local shards; ``earlier``: the steps of a previous fit in these
        processes, whose master weights carry over."""
        masters = self.zero1 and ZeroPolicy.of(self.parallelism, self.meshes.layout).keeps_master_weights(
            self.precision
        )
        self.module = module
        kept = {key: _local(value) for key, value in earlier.master_weights().items()} if earlier else {}
        if earlier is not None:
            earlier.remove_hooks()
        mesh = self.meshes.sharding if self.zero1 else None
        dtype = reduce_dtype(self.precision, self.parallelism.mixed_precision_reduce)
        self.local = {
            id(opt): LocalShardOptimizer(
                opt, mesh, dtype, module, self.meshes.experts, torch.bfloat16 if masters else None, kept
            )
            for opt in optimizers
            if self.zero1 or (self.split and isinstance(opt, ELEMENTWISE_OPTIMIZERS) and _has_dtensor_params(opt))
        }
        if self.parallelism.runs_outer_loop:
            self.outer_loop = build_outer_loop(self.parallelism, self.meshes, module, optimizers, self.local)

    def step(self, optimizer: Any, closure: Callable[[], Any], inner_step: Callable[[Callable[[], Any]], Any]) -> Any:
        """``inner_step(closure)`` is Lightning's step (the precision plugin's: closure, clipping, the step); around
        it, ZeRO-1's reduce-scatter after the closure and all-gather after the step, then DiLoCo's outer step. With
        replica groups, the closure's gradients are averaged across the groups before the step, or with DiLoCo, the
        pseudo-gradients at the outer step (`lit3d.strategies.runtime.replica_groups`)."""
        local = self.local.get(id(optimizer))

        def closure_then_scatter() -> Any:  # forward and backward; gradient clipping follows
            overlapped = local.zero1 and self.meshes.layout.pp == 1
            with local.overlap() if overlapped else nullcontext():
                result = closure()
            local.scatter_grads()
            return result

        prepared = closure if local is None else closure_then_scatter
        groups, outer = self.replica_groups, self.outer_loop
        if groups is not None and outer is None:  # each step averaged across the groups
            result = groups.step(optimizer, prepared, inner_step)
        else:
            if groups is not None:  # each group a DiLoCo island: the groups that train the round meet as it starts
                groups.before_inner_step(outer.starts_round())
            result = inner_step(prepared)
        if outer is not None:  # NOTE: before the gather: only this rank's slices cross the island link
            outer.after_inner_step(groups)
        if local is not None:
            local.gather_params()
        self._after_step()
        return result

    def _after_step(self) -> None:
        if self.parallelism.float8_all_gather:  # the FP8 scales of the updated weights, for the next gathers
            precompute_scales([self.module])

    def clip_grad_norm(self, optimizer: Any, clip_val: float, parameters: Any) -> None:
        """Clip by the norm over every shard and stage (Lightning's would take this process's parameters only)."""
        pipeline_group = self.meshes.group("pp")
        local = self.local.get(id(optimizer))
        if local is not None and local.zero1:  # the gradients are the DP averages of the optimizer's slices now
            local.clip_grad_norm_(clip_val, pipeline_group)
            return
        clip_grad_norm_(parameters, clip_val, pipeline_group)

    def master_weights(self) -> dict[int, torch.Tensor]:
        """The fp32 master weights by id of their bf16 parameter (ZeRO-1 under bf16-mixed), each a DTensor slice."""
        return {key: value for local in self.local.values() for key, value in local.master_weights().items()}

    def with_master_weights(self, module: nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with the fp32 master weights in place of the bf16 parameters that have them: what
        checkpoints save and load."""
        masters = self.master_weights()
        if not masters:
            return state_dict
        parameters = module.named_parameters(remove_duplicate=False)  # a tied weight under each name
        named = {name: masters[id(p)] for name, p in parameters if id(p) in masters}
        return {key: named.get(key, value) for key, value in state_dict.items()}

    def master_weights_loaded(self) -> None:
        """After a checkpoint filled the master weights (`with_master_weights`): the parameters from them (and with
        FP8 all-gather, the loaded weights' scales)."""
        for local in self.local.values():
            if local.param_dtype is not None:
                local.gather_params()
        if self.module is not None:
            self._after_step()

    def remove_hooks(self) -> None:
        for local in self.local.values():
            local.remove_hooks()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _has_dtensor_params(optimizer: torch.optim.Optimizer) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])
