"""The configuration checks of `Parallel3DStrategy` (a mixin before Lightning's strategy class): run in the
launching process before any rank starts (`lit3d.strategies.launchers`), and again in each rank."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn

from lit3d.strategies.context_parallel import check_context_parallel, check_module_for_context_parallel
from lit3d.strategies.layout import check_model_fits_layout, check_model_fits_pipeline, pipeline_microbatches
from lit3d.strategies.pipeline import check_pipeline_protocol


class ConfigurationChecks:
    def check_configuration(self, trainer: Trainer | None = None, datamodule: Any = None) -> None:
        """Refuse a bad layout or a model it cannot split, before any process group exists (the launcher calls
        this before it starts a rank; ``trainer`` and ``datamodule`` are there before the module knows them)."""
        layout = self.layout
        if self.cluster_environment is not None:  # under torchrun / SLURM: devices x num_nodes = launched ranks
            self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        module = self.lightning_module
        config = getattr(module, "config", None)
        if config is not None:
            check_model_fits_layout(config, layout)
            check_model_fits_pipeline(config, layout.pp, self.virtual_pipeline_size)
        trainer = trainer or getattr(module, "_trainer", None)
        datamodule = datamodule or getattr(trainer, "datamodule", None)
        seq_len = getattr(datamodule, "seq_len", None)
        check_context_parallel(config, layout.cp, seq_len, layout.tp, self.sequence_parallel)
        predicting = trainer is not None and trainer.state.fn == TrainerFn.PREDICTING
        check_module_for_context_parallel(module, layout.cp, predicting)

        if layout.pp > 1 and hasattr(module, "tensor_parallel_plan"):  # one the strategy splits (`model` comes later)
            check_pipeline_protocol(module, layout.pp)
        if layout.pp > 1 and hasattr(datamodule, "global_batch_size"):
            self.num_microbatches = pipeline_microbatches(
                self._num_microbatches, datamodule.global_batch_size, layout.data_replicas,
                trainer.accumulate_grad_batches, layout.pp, self.virtual_pipeline_size, self.pipeline_schedule,
            )  # fmt: skip
