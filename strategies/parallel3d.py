"""`Parallel3DStrategy`: data × tensor × pipeline parallelism with ZeRO, a Lightning strategy on `ModelParallelStrategy`
described by one value (`lit3d.parallel.Parallelism`). It owns its collaborators (``meshes``, ``optimizer_steps``,
``checkpoints``, ``pipeline``, ``rank_life``); its hooks come in the order Lightning calls them. What a module provides
to be split, and the order of the hooks: docs/architecture.md."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from dataclasses import fields
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit3d.checkpoint.save_load import Checkpoints, RankState, remove
from lit3d.checkpoint.whole_file import WholeOrder
from lit3d.errors import ConfigurationError
from lit3d.models.loss import loss_parallel_scope
from lit3d.parallel.arguments import argument_docs
from lit3d.parallel.layout import Layout
from lit3d.parallel.rank_map import layout_lines
from lit3d.parallel.settings import Parallelism
from lit3d.parallel.zero import ZeroPolicy
from lit3d.planner.inputs import Plan
from lit3d.strategies.auto_layout import auto_settings
from lit3d.strategies.checks import check_run
from lit3d.strategies.meshes import ParallelMeshes
from lit3d.strategies.optim.dtypes import clipping_split_model, describe
from lit3d.strategies.optim.steps import OptimizerSteps
from lit3d.strategies.parallelize import follows_plan, move_the_rest, not_splittable, refuse_fsdp1, split_module
from lit3d.strategies.pipelining.step import Pipeline
from lit3d.strategies.runtime.launchers import CheckingLauncher, ForkLauncher, agree_on_seed
from lit3d.strategies.runtime.preemption import StopOnSignal
from lit3d.strategies.runtime.rank_life import RankLife
from lit3d.strategies.runtime.replica_groups import ReplicaGroups, this_group
from lit3d.strategies.runtime.watchdog import batch_kind, report_failure
from lit3d.strategies.split.data_parallel import SyncedByModule, accumulation_sync
from lit3d.strategies.split.tensor_parallel import lay_out_grads_like_params
from lit3d.strategies.telemetry.plan_check import start_plan


class Parallel3DStrategy(ModelParallelStrategy):
    __doc__ = f"""Data × tensor × pipeline (× context, × expert) parallelism with ZeRO; ``world = dp × cp × tp × pp``.

    Its arguments are the fields of `lit3d.parallel.Parallelism` (the one description of a run, which the planner
    takes too); ``Parallel3DStrategy.of(parallelism)`` builds it from one.

    {argument_docs("        ")}
    """

    strategy_name = "3d"

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        data_parallel_shard_size: int | None = None,
        tensor_parallel_size: int | Literal["auto"] = "auto",
        pipeline_parallel_size: int = 1,
        data_parallel_shares: list[int] | None = None,
        expert_parallel_size: int = 1,
        context_parallel_size: int = 1,
        zero_stage: int = 1,
        accumulate_unsharded: bool = False,
        offload: bool = False,
        sequence_parallel: bool = False,
        pipeline_schedule: str = "1f1b",
        num_microbatches: int | None = None,
        virtual_pipeline_size: int | None = None,
        pipeline_stage_layers: list[int] | None = None,
        activation_checkpointing: bool | Literal["full", "selective"] = False,
        compile: bool | str = False,
        mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32",
        float8: Literal["tensorwise", "rowwise"] | None = None,
        float8_all_gather: bool = False,
        async_checkpoint: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=10),
        auto_layout: bool = False,
        auto_memory_gb: float | None = None,
        plan_profile: str | None = None,
        start_method: Literal["popen", "fork"] | None = None,
        islands: int = 1,
        sync_every: int = 1,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_fragments: int = 1,
        outer_reduce_dtype: Literal["float32", "bfloat16"] = "float32",
        replica_groups: int | None = None,
    ) -> None:
        settings = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        self.parallelism = Parallelism(**settings)  # refused here, before anything starts, naming the values
        for warning in self.parallelism.warnings():
            rank_zero_warn(warning)
        if offload and process_group_backend is None and torch.cuda.is_available():
            process_group_backend = "cuda:nccl,cpu:gloo"  # offloaded gradients meet (their norm) on the CPU: gloo
        super().__init__(
            data_parallel_size, tensor_parallel_size, save_distributed_checkpoint, process_group_backend, timeout
        )
        self.num_microbatches = self.parallelism.microbatches()  # until the batch is known (`check_configuration`)
        self._layout: Layout | None = None
        self.meshes: ParallelMeshes | None = None  # built in setup_environment
        self.optimizer_steps: OptimizerSteps | None = None  # built with the optimizers
        self.checkpoints = Checkpoints(async_checkpoint, save_distributed_checkpoint)
        self.pipeline: Pipeline | None = None  # this rank's stages and schedule, when pipeline_parallel_size > 1
        self.rank_life = RankLife()  # the launcher watch and the watchdog: neither outlives a fit
        self._parallelized: nn.Module | None = None  # the network this strategy split
        self.plan: Plan | None = None  # the planner's estimate of this run (a lit3d GPT only), set at fit start
        self._whole_order: WholeOrder | None = None  # the network's names before the split (`full_state`)
        self.synced_by_module: SyncedByModule | None = None  # what a module keeps in sync itself, checked
        self.memory_estimate: dict[str, int] | None = None  # the planner's bytes for this rank's stage
        self._replica_group: int | None = None  # this job's group (`replica_groups`: REPLICA_GROUP_ID)

    @classmethod
    def of(cls, parallelism: Parallelism) -> Parallel3DStrategy:
        """The strategy that runs ``parallelism``."""
        return cls(**{f.name: getattr(parallelism, f.name) for f in fields(parallelism)})

    @property
    def layout(self) -> Layout:
        """Sizes and rank coordinates, checked against the launched ranks (``"auto"`` resolved for the module)."""
        if self._layout is None:
            if not self.num_processes:
                raise RuntimeError("Parallel3DStrategy has no devices yet: a Trainer sets them up")
            world = self.num_nodes * self.num_processes
            self._layout = self.parallelism.resolve(world, self.num_processes, self._lit3d_splits)
        return self._layout

    @property
    @override
    def precision_plugin(self) -> Precision:
        return super().precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:  # lit3d's: clipping by the whole model's norm
        self._precision_plugin = clipping_split_model(plugin, self._clip_grad_by_norm)

    @property
    def _lit3d_splits(self) -> bool:  # the module follows lit3d's protocol (`follows_plan` once it is built)
        return self.lightning_module is None or hasattr(self.lightning_module, "tensor_parallel_plan")

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:  # over DP replicas only (CP: `ContextShare`)
        replicas, rank = self.layout.data_replicas, self.layout.data_rank(self.global_rank)
        groups, group = self.parallelism.replica_groups or 1, self._replica_group or 0  # (`replica_groups`)
        return {"num_replicas": groups * replicas, "rank": group * replicas + rank}

    def check_configuration(self, trainer: Trainer | None = None, datamodule: Any = None) -> None:
        """Refuse a bad layout or a model it cannot split before any process group exists (the launcher calls this
        before it starts a rank), as a `ConfigurationError` naming the values (`lit3d.strategies.checks.check_run`);
        with ``auto_layout``, the planner chooses the layout first (`lit3d.strategies.auto_layout`)."""
        try:
            if self.cluster_environment is not None:  # under torchrun / SLURM: devices x num_nodes = launched ranks
                self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
            if self.meshes is not None:  # an earlier stage's (`teardown`): this stage's module may differ
                self._layout, self.meshes = None, None
            module = self.lightning_module
            trainer = trainer or getattr(module, "_trainer", None)
            datamodule = datamodule or getattr(trainer, "datamodule", None)
            if self.parallelism.auto_layout and self._layout is None:  # (once per process, before the layout)
                self.parallelism = auto_settings(self, module, trainer, datamodule)
            self.num_microbatches = check_run(self.parallelism, self.layout, module, trainer, datamodule)
            if self.parallelism.replica_groups is not None:  # torchft, REPLICA_GROUP_ID, a lighthouse that answers
                self._replica_group = this_group(self.parallelism.replica_groups)[0]
        except (ValueError, TypeError) as error:
            raise ConfigurationError(str(error)) from error

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            fork = self.parallelism.resolved_start_method() == "fork"
            self._launcher = ForkLauncher(self) if fork else CheckingLauncher(self)

    @override
    def setup_environment(self) -> None:
        self.check_configuration()
        self.rank_life.before_process_group()
        _set_num_threads_if_needed(self.num_processes)  # CPU ranks share the cores (torchrun sets 1)
        self._setup_distributed()  # Lightning's: device, seed, world ranks, process group
        agree_on_seed()
        self.rank_life.after_process_group(self.global_rank, self.world_size, self._timeout.total_seconds())
        layout = self.layout
        self.meshes = ParallelMeshes.build(layout, self.root_device.type)
        self._device_mesh = self.meshes.for_modules  # Lightning's dim names (`ParallelMeshes.for_modules`)
        self.lightning_module._device_mesh = self._device_mesh  # for modules that parallelise themselves
        for line in layout_lines(layout, self.parallelism, self.num_microbatches, self._lit3d_splits):
            rank_zero_info(line)
        if layout.tp_groups_across_nodes():
            rank_zero_warn(layout.tp_across_nodes_warning())

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Modules the strategy splits are built empty (meta) and get their weights in `setup`, after being split;
        # one that parallelises itself is built as under `ModelParallelStrategy` (so its random init is the same).
        device = torch.device("meta") if empty_init or (self._lit3d_splits and empty_init is None) else nullcontext()
        with device, self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        refuse_fsdp1(module)
        if follows_plan(module):
            self.model = self.precision_plugin.convert_module(self.model)
            self._split(module)
        elif is_overridden("configure_model", module):
            _materialize_distributed_module(self.model, self.root_device)
            self.model = self.precision_plugin.convert_module(self.model)
        else:
            raise not_splittable(module)
        self.model_to_device()
        if self.layout.replicas > 1:  # before any step: replicas that are not kept in sync would silently drift
            chunks = tuple(self.pipeline.chunks) if self.pipeline is not None else ()
            self.synced_by_module = SyncedByModule.check(module, self.meshes.replica_mesh, chunks)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            if not any(isinstance(callback, StopOnSignal) for callback in trainer.callbacks):
                trainer.callbacks.append(StopOnSignal())  # SIGTERM / SIGUSR1: agree, save, exit to be requeued
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            if not self.parallelism.offload:  # offloaded states stay in host memory
                _optimizers_to_device(self.optimizers, self.root_device)
            if self.layout.world_size > 1 and self._parallelized is not None:  # what each axis sends, in which dtype
                rank_zero_info(describe(self.parallelism, self.layout, self.precision_plugin.precision))
            self.plan, self.memory_estimate = start_plan(self, trainer)  # and the check that holds the run to it
            if self.parallelism.replica_groups is not None:  # (last: a joining group loads a live group's state)
                self.optimizer_steps.replica_groups = self.rank_life.replica_groups = ReplicaGroups.join(self, trainer)

    def _split(self, module: LightningModule) -> None:
        """Split ``module.model`` for this rank and give the module the runner of its part (`split_module`)."""
        if self._parallelized is module.model:
            return  # a later call in the same processes (fit, then validate or test): it is split already
        self._parallelized = module.model
        self._whole_order = WholeOrder.of(module)  # NOTE: before the split: a pipeline rank holds only its part
        rank, device, plugin = self.global_rank, self.root_device, self.precision_plugin
        module.runner, self.pipeline = split_module(
            module, self.parallelism, self.meshes, rank, self.num_microbatches, device, plugin
        )

    @override
    def model_to_device(self) -> None:
        module = self.lightning_module
        if self._parallelized is None or module is None:
            return super().model_to_device()
        move_the_rest(module, self._parallelized, self.root_device)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)  # Lightning's drops the optimizers of an earlier setup first
        # ZeRO-1 where the strategy applied data parallelism; a module that parallelises itself chose its own.
        split = self._parallelized is not None
        zero1 = ZeroPolicy.of(self.parallelism, self.layout).slices_optimizer and split
        earlier, self.optimizer_steps = (
            self.optimizer_steps,
            OptimizerSteps(self.parallelism, self.meshes, self.precision_plugin.precision, zero1, split),
        )
        self.optimizer_steps.build(self.optimizers, self.lightning_module, earlier)

    @override
    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        # NOTE: every loop (training, validation, test, prediction) moves each batch here first: one beat per batch.
        stage = self.lightning_module.trainer.state.stage
        self._beat(f"a {batch_kind(stage)} batch")
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        def step() -> Any:  # Lightning's: the module's training_step, whose loss runs the schedule
            return super(Parallel3DStrategy, self).training_step(*args, **kwargs)

        if self.pipeline is None:
            return step()
        return self.pipeline.clocked_step(self.lightning_module, self.parallelism, step)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if self.layout.world_size == 1:  # nothing to reduce: no collective on every logged value
            return tensor
        return super().reduce(tensor, group, reduce_op)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """The micro-steps of an accumulation window but the last (`accumulation_sync`)."""
        # NOTE: under pipeline parallelism the schedule itself syncs once per schedule, after its micro-batches.
        modules = [] if self.pipeline is not None else list(self.lightning_module.modules())
        with accumulation_sync(modules, ZeroPolicy.of(self.parallelism, self.layout)):
            yield

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        module = self.lightning_module
        if self.pipeline is not None:
            # The schedule already ran backward, micro-batch by micro-batch, in the training step: its gradients
            # join the parameters' now, where Lightning expects backward.
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            self.pipeline.accumulate_gradients()
            return self.precision_plugin.post_backward(closure_loss, module)
        # The vocabulary-parallel loss's backward needs DTensor's loss_parallel handlers too: lit3d's own, around the
        # modules it split (a module that parallelises itself enters its own `loss_parallel()`, as under Lightning).
        with loss_parallel_scope() if self.layout.tp > 1 and self._parallelized is not None else nullcontext():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.layout.tp > 1:
            lay_out_grads_like_params(self.lightning_module.parameters())

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        def inner_step(closure: Any) -> Any:  # Lightning's: the closure, gradient clipping, the step
            return super(Parallel3DStrategy, self).optimizer_step(optimizer, closure, model, **kwargs)

        if self.optimizer_steps is None:
            return inner_step(closure)
        result = self.optimizer_steps.step(optimizer, closure, inner_step)
        if self.synced_by_module is not None:  # did the module's own hooks keep its replicas together?
            self.synced_by_module.after_step()
        return result

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self.optimizer_steps.clip_grad_norm(optimizer, clip_val, self.lightning_module.parameters())

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Shards by name; without distributed checkpoints, Lightning's: the whole state on rank 0 (a collective)."""
        return self.checkpoints.module_state(self._rank_state())

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """By name; without distributed checkpoints, one process's ``state_dict()`` on rank 0 (a collective)."""
        return self.checkpoints.optimizer_state(self._rank_state(), optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self._beat("a checkpoint save")
        path = Path(self.broadcast(str(filepath)))  # rank 0's name
        self.checkpoints.save(path, checkpoint, self._rank_state().islands(), self.is_global_zero, storage_options)
        self._beat("training after a checkpoint save")

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path, module = Path(self.broadcast(str(checkpoint_path))), self.lightning_module
        fitting = module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        return self.checkpoints.load(path, self._rank_state(), self.optimizers if fitting else [])

    def _rank_state(self) -> RankState:  # before any setup: the module alone, as one process
        layout, module = self.layout if self.meshes is not None else None, self.lightning_module
        return RankState(module, self.optimizer_steps, layout, self.global_rank, self._whole_order)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # `load_checkpoint` already filled the parameters in place

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # likewise

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        remove(Path(filepath)) if self.is_global_zero else None

    @override
    def on_train_end(self) -> None:
        self.checkpoints.wait()  # the end of training waits for the last save (and reports its failure)
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        report_failure(self.global_rank, self.world_size, getattr(self.lightning_module, "_trainer", None), exception)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self.checkpoints.abandon()  # a save still in flight when the fit ended by an error
        self.rank_life.stop()
        super().teardown()  # NOTE: the layout and meshes stay until the next stage's check: a save after fit needs them

    def _beat(self, doing: str) -> None:
        if self.rank_life.watchdog is not None:
            self.rank_life.beat(f"the start of {doing} (step {self.lightning_module.trainer.global_step})")
