"""The optimizer hooks of `Parallel3DStrategy` (a mixin before Lightning's strategy class): steps on local shards,
ZeRO-1's reduce-scatter and all-gather around them, gradient clipping by the norm of the whole split model, and
DiLoCo's outer step after the inner one (`lit3d.strategies.islands`)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from lightning.pytorch import Trainer
from typing_extensions import override

from lit3d.strategies.grad_norm import clip_grad_norm_
from lit3d.strategies.islands import build_outer_loop
from lit3d.strategies.precision import reduce_dtype
from lit3d.strategies.zero1 import ELEMENTWISE_OPTIMIZERS, LocalShardOptimizer


class LocalOptimizerSteps:
    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)  # Lightning's drops the optimizers of an earlier setup first
        # ZeRO-1 where the strategy applied data parallelism; a module that parallelises itself chose its own.
        zero1 = self.zero_stage == 1 and self.layout.replicas > 1 and self._parallelized is not None
        mesh, dtype = self.replica_mesh if zero1 else None, reduce_dtype(self.precision, self.mixed_precision_reduce)
        self._local_optimizers = {
            id(opt): LocalShardOptimizer(opt, mesh, dtype, self.lightning_module, self._expert_mesh)
            for opt in self.optimizers
            if zero1 or (isinstance(opt, ELEMENTWISE_OPTIMIZERS) and _has_dtensor_params(opt))
        }
        diloco = self.layout.islands > 1 or self.sync_every > 1
        self.outer_loop = build_outer_loop(self, self.optimizers) if diloco else None

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        local = self._local_optimizers.get(id(optimizer))
        if local is None:
            result = super().optimizer_step(optimizer, closure, model, **kwargs)
            if self.outer_loop is not None:
                self.outer_loop.after_inner_step()
            return result

        def closure_then_scatter() -> Any:  # Lightning's closure: forward, backward (gradient clipping follows)
            with local.overlap() if local.zero1 and self.layout.pp == 1 else nullcontext():
                result = closure()
            local.scatter_grads()
            return result

        result = super().optimizer_step(optimizer, closure_then_scatter, model, **kwargs)
        if self.outer_loop is not None:  # NOTE: before the gather: only this rank's slices cross the island link
            self.outer_loop.after_inner_step()
        local.gather_params()
        return result

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        pipeline_group = self.device_mesh["pp"].get_group() if self.layout.pp > 1 else None
        local = self._local_optimizers.get(id(optimizer))
        if local is not None and local.zero1:  # the gradients are the DP averages of the optimizer's slices now
            local.clip_grad_norm_(clip_val, pipeline_group)
            return
        clip_grad_norm_(self.lightning_module.parameters(), clip_val, pipeline_group)


def _has_dtensor_params(optimizer: torch.optim.Optimizer) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])
