"""The optimizer hooks of `Parallel3DStrategy` (a mixin before Lightning's strategy class): steps on local shards,
ZeRO-1's reduce-scatter and all-gather around them (under bf16-mixed on fp32 master weights), gradient clipping by
the norm of the whole split model, and DiLoCo's outer step after the inner one (`lit3d.strategies.islands`)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from lightning.pytorch import Trainer
from typing_extensions import override

from lit3d.parallel.precision import keeps_master_weights
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
        masters = zero1 and keeps_master_weights(self.precision, self.zero_stage, self.layout.replicas)
        earlier = {key: _local(value) for key, value in self._master_weights().items()}  # a second fit's setup
        for local in self._local_optimizers.values():
            local.remove_hooks()
        self._local_optimizers = {
            id(opt): LocalShardOptimizer(
                opt, mesh, dtype, self.lightning_module, self._expert_mesh, torch.bfloat16 if masters else None, earlier
            )
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

    def with_master_weights(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The module's ``state_dict`` with the fp32 master weights in place of bf16 parameters that have them
        (ZeRO-1 under bf16-mixed), each a DTensor of this rank's slice: what checkpoints save and load."""
        masters = self._master_weights()
        if not masters:
            return state_dict
        parameters = self.lightning_module.named_parameters(remove_duplicate=False)  # a tied weight under each name
        named = {name: masters[id(p)] for name, p in parameters if id(p) in masters}
        return {key: named.get(key, value) for key, value in state_dict.items()}

    def _master_weights(self) -> dict[int, torch.Tensor]:
        return {
            key: value for local in self._local_optimizers.values() for key, value in local.master_weights().items()
        }

    def master_weights_loaded(self) -> None:
        """After a checkpoint filled the master weights (`with_master_weights`): the parameters from them."""
        for local in self._local_optimizers.values():
            if local.param_dtype is not None:
                local.gather_params()

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        pipeline_group = self.device_mesh["pp"].get_group() if self.layout.pp > 1 else None
        local = self._local_optimizers.get(id(optimizer))
        if local is not None and local.zero1:  # the gradients are the DP averages of the optimizer's slices now
            local.clip_grad_norm_(clip_val, pipeline_group)
            return
        clip_grad_norm_(self.lightning_module.parameters(), clip_val, pipeline_group)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _has_dtensor_params(optimizer: torch.optim.Optimizer) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])
