"""The training-step hooks of `Parallel3DStrategy` (a mixin before Lightning's strategy class): a pipeline's
schedule in place of forward and backward (with its metrics on the steps Lightning logs), the vocabulary-parallel
loss's backward, gradients laid out like their parameters, and no gradient sync on the micro-steps before the last."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from typing_extensions import override

from lit3d.model import loss_parallel_scope
from lit3d.parallel.schedules import Costs, bubble_theory
from lit3d.strategies.tensor_parallel import lay_out_grads_like_params
from lit3d.strategies.timeline import PipelineTimeline
from lit3d.strategies.zero import gradient_sync_off


class StepHooks:
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().training_step(*args, **kwargs)
        # NOTE: the stage clock runs, and its metrics are gathered (a collective and a host sync), only on the
        # steps Lightning logs or a timeline draws.
        trainer = self.lightning_module.trainer
        logs = trainer._logger_connector.should_update_logs
        timelines = [cb for cb in trainer.callbacks if isinstance(cb, PipelineTimeline)]
        self.pipeline.clock.enabled = logs or any(cb.wants(trainer) for cb in timelines)
        output = super().training_step(*args, **kwargs)
        if logs:
            self._log_pipeline_activity()
        return output

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if self.layout.world_size == 1:  # nothing to reduce: no collective on every logged value
            return tensor
        return super().reduce(tensor, group, reduce_op)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        module = self.lightning_module
        if self.pipeline is not None:
            # The schedule already ran backward, micro-batch by micro-batch, in the training step: its gradients
            # join the parameters' now, where Lightning expects backward.
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            self.pipeline.accumulate_gradients()
            return self.precision_plugin.post_backward(closure_loss, module)
        # The vocabulary-parallel loss's backward needs DTensor's loss_parallel handlers too.
        with loss_parallel_scope() if self.layout.tp > 1 else nullcontext():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.layout.tp > 1:
            lay_out_grads_like_params(self.lightning_module.parameters())

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient communication on the micro-steps of an accumulation window but the last."""
        # NOTE: under pipeline parallelism the schedule itself syncs once per schedule, after its micro-batches.
        modules = [] if self.pipeline is not None else list(self.lightning_module.modules())
        with gradient_sync_off(modules, keep_gathered=self.zero_stage == 2):
            yield

    def _log_pipeline_activity(self) -> None:
        """Each stage's busy time, and the measured idle share of the step next to the schedule's theory."""
        costs = Costs.of(self.activation_checkpointing)
        theory = bubble_theory(
            self.pipeline_schedule, self.layout.pp, self.num_microbatches, self.virtual_pipeline_size, costs
        )
        for name, value in {**self.pipeline.activity(), "pp/bubble_theory": theory}.items():
            self.lightning_module.log(name, value, on_step=True, rank_zero_only=True, batch_size=1)
