"""The configuration checks of `Parallel3DStrategy` (a mixin before Lightning's strategy class): run in the
launching process before any rank starts (`lit3d.strategies.launchers`), and again in each rank."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit3d.parallel.context import check_context_parallel
from lit3d.parallel.layout import (
    check_choices,
    check_islands,
    check_model_fits_layout,
    check_model_fits_pipeline,
    check_pipeline_arguments,
    check_sizes,
    pipeline_microbatches,
)
from lit3d.parallel.outer import check_outer_loop
from lit3d.parallel.precision import check_reduce_dtype
from lit3d.parallel.schedules import check_composes
from lit3d.strategies.context_parallel import check_module_for_context_parallel
from lit3d.strategies.launchers import interactive
from lit3d.strategies.pipeline import check_pipeline_protocol
from lit3d.strategies.recompute import check_setting


class ConfigurationError(ValueError):
    """A configuration refused before any process group exists: in the launching process before any rank starts, or
    first thing in each rank that torchrun or SLURM started. Nothing has run, so nothing failed: the ``lit3d`` command
    prints it as one line, and the watchdog does not report it as a failed rank."""


class ConfigurationChecks:
    @staticmethod
    def check_arguments(
        *,
        data_parallel_size: int | str,
        tensor_parallel_size: int,
        pipeline_parallel_size: int,
        expert_parallel_size: int,
        context_parallel_size: int,
        zero_stage: int,
        sequence_parallel: bool,
        pipeline_schedule: str,
        num_microbatches: int | None,
        virtual_pipeline_size: int | None,
        activation_checkpointing: bool | str,
        compile: bool | str,
        mixed_precision_reduce: str,
        async_checkpoint: bool,
        start_method: str | None,
        islands: int,
        sync_every: int,
        outer_lr: float,
        outer_momentum: float,
        outer_fragments: int,
        outer_reduce_dtype: str,
        **others: Any,  # (process_group_backend, timeout: Lightning's to check)
    ) -> None:
        """`Parallel3DStrategy`'s arguments that no run could use, refused in its constructor, naming the values."""
        check_sizes(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            expert_parallel_size=expert_parallel_size,
            context_parallel_size=context_parallel_size,
        )
        check_choices(zero_stage, pipeline_schedule)
        check_pipeline_arguments(pipeline_parallel_size, pipeline_schedule, num_microbatches, virtual_pipeline_size)
        check_composes(pipeline_schedule, pipeline_parallel_size, compile, zero_stage)
        check_setting(activation_checkpointing)
        check_reduce_dtype(mixed_precision_reduce)
        check_outer_loop(islands, sync_every, outer_lr, outer_momentum, outer_fragments, outer_reduce_dtype)
        if data_parallel_size != "auto":
            check_islands(islands, data_parallel_size, expert_parallel_size, context_parallel_size)
        if sequence_parallel and tensor_parallel_size == 1:
            rank_zero_warn("sequence_parallel=True does nothing with tensor_parallel_size=1")
        if start_method not in (None, "popen", "fork"):
            raise ValueError(f"start_method={start_method!r} is not one of 'popen', 'fork' (or None: automatic)")
        if start_method == "popen" and interactive():
            raise ValueError(
                "start_method='popen' cannot start ranks from a notebook or an interactive session: "
                "use start_method='fork' (or leave it unset), or run a script"
            )
        if not isinstance(async_checkpoint, bool):
            raise ValueError(f"async_checkpoint={async_checkpoint!r} must be True or False")

    def check_configuration(self, trainer: Trainer | None = None, datamodule: Any = None) -> None:
        """Refuse a bad layout or a model it cannot split, before any process group exists (the launcher calls
        this before it starts a rank; ``trainer`` and ``datamodule`` are there before the module knows them), as a
        `ConfigurationError` naming the values."""
        try:
            self._check_layout_and_module(trainer, datamodule)
        except (ValueError, TypeError) as error:
            raise ConfigurationError(str(error)) from error

    def _check_layout_and_module(self, trainer: Trainer | None, datamodule: Any) -> None:
        layout = self.layout
        if self.cluster_environment is not None:  # under torchrun / SLURM: devices x num_nodes = launched ranks
            self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        module = self.lightning_module
        config = getattr(module, "config", None)
        if config is not None:
            check_model_fits_layout(config, layout)
            check_model_fits_pipeline(config, layout.pp, self.virtual_pipeline_size, self.pipeline_schedule)
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
