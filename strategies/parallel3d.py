"""`Parallel3DStrategy`: data × tensor × pipeline parallelism with ZeRO, as a Lightning strategy.

A Strategy owns *where* things run; the LightningModule owns *what* is computed. This one builds on Lightning's
`ModelParallelStrategy` (devices, process group, collectives, teardown) and adds the ``(pp, dp, tp)`` mesh, the
split of the network (`lit3d.strategies.parallelize`), ZeRO-1's sharded optimizer step, the pipeline schedule
and layout-free sharded checkpoints.

One ``lit3d fit`` passes through these hooks, in order:

1. ``check_configuration``: the layout and the model, in the launching process, before any rank starts
   (`lit3d.strategies.launchers`), and again in each rank;
2. ``setup_environment``: the process group, one seed for all ranks, the device mesh, the rank map;
3. ``tensor_init_context``: ``configure_model`` builds the network empty, on the meta device;
4. ``setup`` → ``parallelize``: the network is split in the fixed order (pipeline stages → tensor parallel →
   activation checkpointing → compile → data parallel / ZeRO), then given its weights, shard by shard, from
   the seed and the parameter names; then ``setup_optimizers`` (ZeRO-1 and DTensor shards get
   `LocalShardOptimizer`) and the planner's estimate of the run;

and every optimizer step:

5. ``training_step``: the module's step; with a pipeline, its ``loss`` runs the schedule (forward and backward
   of every micro-batch) around the module's ``loss_fn``;
6. ``block_backward_sync`` on the micro-steps before the last of an accumulation window (no gradient traffic);
7. ``backward`` (under the vocabulary-parallel loss's handlers with TP; with a pipeline, the gradients the
   schedule computed join the parameters') and ``post_backward`` (DTensor gradients in their parameters' layout);
8. ``optimizer_step``: with ZeRO-1 the reduce-scatter of the gradients, gradient clipping by the norm over every
   shard and stage, the step on local shards, and with ZeRO-1 the all-gather of the updated slices.

A LightningModule is split by the strategy when it follows lit3d's protocol (like `lit3d.GPT`): a ``model``
with ``blocks`` (a ModuleDict of decoder blocks) and a ``tensor_parallel_plan`` (module name pattern → role,
see `lit3d.strategies.tensor_parallel`). For pipeline parallelism the module also says how its loss is made:
``inputs_and_targets(batch)`` and ``loss_fn(outputs, targets)``, with its steps calling ``self.loss(batch)``
(``loss_fn(model(inputs), targets)``); the strategy then runs that as the schedule. Any other module overrides
``configure_model`` and parallelises itself with ``self.device_mesh``, as with ``ModelParallelStrategy``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from dataclasses import fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn as nn
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit3d.parallel.layout import Layout, pipeline_microbatches, resolve_layout
from lit3d.parallel.schedules import chunks_per_rank, describe_schedule
from lit3d.parallel.settings import Parallelism, argument_docs
from lit3d.strategies.checkpoint import ShardedCheckpoints
from lit3d.strategies.checks import ConfigurationError, check_run
from lit3d.strategies.context_parallel import route_context_parallel
from lit3d.strategies.islands import OuterLoop
from lit3d.strategies.launchers import (
    CheckingLauncher,
    ForkLauncher,
    agree_on_seed,
    exit_when_launcher_dies,
)
from lit3d.strategies.memory import memory_by_component
from lit3d.strategies.optimizers import LocalOptimizerSteps
from lit3d.strategies.parallelize import follows_plan, parallelize_network
from lit3d.strategies.pipeline import Pipeline
from lit3d.strategies.precision import describe, mixed_precision_policy, uses_ddp
from lit3d.strategies.preemption import StopOnSignal
from lit3d.strategies.steps import StepHooks
from lit3d.strategies.watchdog import WatchedSteps
from lit3d.strategies.zero import check_replicas_in_sync
from lit3d.strategies.zero1 import LocalShardOptimizer

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lit3d.planner.estimate import Plan


class Parallel3DStrategy(WatchedSteps, ShardedCheckpoints, StepHooks, LocalOptimizerSteps, ModelParallelStrategy):
    __doc__ = f"""Data × tensor × pipeline (× context, × expert) parallelism with ZeRO; ``world = dp × cp × tp × pp``.

    Its arguments are the fields of `lit3d.parallel.Parallelism` (the one description of a run, which the planner
    takes too); ``Parallel3DStrategy.of(parallelism)`` builds it from one.

    {argument_docs("        ")}
    """

    strategy_name = "3d"

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        context_parallel_size: int = 1,
        zero_stage: int = 1,
        sequence_parallel: bool = False,
        pipeline_schedule: str = "1f1b",
        num_microbatches: int | None = None,
        virtual_pipeline_size: int | None = None,
        activation_checkpointing: bool | Literal["full", "selective"] = False,
        compile: bool | str = False,
        mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32",
        async_checkpoint: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=10),
        start_method: Literal["popen", "fork"] | None = None,
        islands: int = 1,
        sync_every: int = 1,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_fragments: int = 1,
        outer_reduce_dtype: Literal["float32", "bfloat16"] = "float32",
    ) -> None:
        settings = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        self.parallelism = Parallelism(**settings)  # refused here, before anything starts, naming the values
        for warning in self.parallelism.warnings():
            rank_zero_warn(warning)
        super().__init__(data_parallel_size, tensor_parallel_size, True, process_group_backend, timeout)
        self.start_method = self.parallelism.resolved_start_method()
        self._sizes = tuple(self.parallelism.sizes().values()) + (islands,)
        self.islands, self.sync_every, self.outer_fragments = islands, sync_every, outer_fragments
        self.outer_lr, self.outer_momentum, self.outer_reduce_dtype = outer_lr, outer_momentum, outer_reduce_dtype
        self.outer_loop: OuterLoop | None = None  # DiLoCo's outer step, built with the optimizers
        self.zero_stage = zero_stage
        self.sequence_parallel = sequence_parallel and tensor_parallel_size > 1
        self.pipeline_schedule = pipeline_schedule
        self.virtual_pipeline_size = chunks_per_rank(pipeline_schedule, virtual_pipeline_size)
        self.num_microbatches = pipeline_microbatches(  # until the batch is known
            num_microbatches, global_batch_size=None, dp=1, accumulate=1, pp=pipeline_parallel_size,
            virtual=self.virtual_pipeline_size, schedule=pipeline_schedule,
        )  # fmt: skip
        self.activation_checkpointing = activation_checkpointing
        self.compile = compile
        self.mixed_precision_reduce = mixed_precision_reduce
        self.async_checkpoint = async_checkpoint
        self._layout: Layout | None = None
        self._replica_mesh: DeviceMesh | None = None  # (pp, dp, tp), its dp the dp x cp ranks with the same weights
        self._cp_group: Any = None  # the ring attention's group, with context parallelism
        self._expert_mesh: DeviceMesh | None = None  # (pp, edp, ep, tp), with expert parallelism
        self._ep_group: Any = None  # the process group MoE layers dispatch their tokens over
        self._local_optimizers: dict[int, LocalShardOptimizer] = {}
        self.pipeline: Pipeline | None = None  # this rank's stages and schedule, when pipeline_parallel_size > 1
        self._parallelized: nn.Module | None = None  # the network this strategy split
        self.plan: Plan | None = None  # the planner's estimate of this run (a lit3d GPT only), set at fit start
        self.memory_estimate: dict[str, int] | None = None  # the planner's bytes for this rank's stage

    # ------------------------------------------------------------------ where things run

    @classmethod
    def of(cls, parallelism: Parallelism) -> Parallel3DStrategy:
        """The strategy that runs ``parallelism``."""
        return cls(**{f.name: getattr(parallelism, f.name) for f in fields(parallelism)})

    def check_configuration(self, trainer: Trainer | None = None, datamodule: Any = None) -> None:
        """Refuse a bad layout or a model it cannot split, before any process group exists (the launcher calls
        this before it starts a rank; ``trainer`` and ``datamodule`` are there before the module knows them), as a
        `ConfigurationError` naming the values (`lit3d.strategies.checks.check_run`)."""
        try:
            if self.cluster_environment is not None:  # under torchrun / SLURM: devices x num_nodes = launched ranks
                self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
            module = self.lightning_module
            trainer = trainer or getattr(module, "_trainer", None)
            datamodule = datamodule or getattr(trainer, "datamodule", None)
            self.num_microbatches = check_run(self.parallelism, self.layout, module, trainer, datamodule)
        except (ValueError, TypeError) as error:
            raise ConfigurationError(str(error)) from error

    @property
    def layout(self) -> Layout:
        """Sizes and rank coordinates (checked against the number of launched ranks)."""
        if self._layout is None:
            self._layout = resolve_layout(self.num_nodes * self.num_processes, self.num_processes, *self._sizes)
        return self._layout

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Data is split over DP replicas only: all TP, CP and PP ranks of a replica see the same batch (each CP
        # rank keeps its share of every sequence: `route_context_parallel`).
        return {"num_replicas": self.layout.data_replicas, "rank": self.layout.data_rank(self.global_rank)}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = ForkLauncher(self) if self.start_method == "fork" else CheckingLauncher(self)

    @override
    def setup_environment(self) -> None:
        self.check_configuration()
        exit_when_launcher_dies()
        _set_num_threads_if_needed(self.num_processes)  # CPU ranks share the cores (torchrun sets 1)
        self._setup_distributed()  # Lightning's: device, seed, world ranks, process group
        agree_on_seed()
        self.start_watchdog()  # a rank that stops making progress says where it is (`lit3d.strategies.watchdog`)
        layout = self.layout
        self._device_mesh = layout.build_mesh(self.root_device.type)
        self._replica_mesh = layout.build_replica_mesh(self._device_mesh)
        if layout.cp > 1:
            # NOTE: the ring's own group, as for EP: the mesh's CP group may be the very group the weights sync over
            # (dp == 1), and `CommReport` tells ring bytes from gradient bytes by group.
            self._cp_group, _ = torch.distributed.new_subgroups_by_enumeration(layout.cp_groups())
        if layout.ep > 1:
            self._expert_mesh = layout.build_expert_mesh(self.root_device.type)
            # NOTE: a group of its own for the tokens' all-to-alls, apart from the mesh's (which may be the very DP
            # group when ep == dp), so `CommReport` tells expert-parallel bytes from data-parallel ones.
            self._ep_group, _ = torch.distributed.new_subgroups_by_enumeration(layout.ep_groups())
        self.lightning_module._device_mesh = self._device_mesh  # for modules that parallelise themselves
        rank_zero_info(layout.rank_map())
        if layout.pp > 1:
            microbatches, chunks = self.num_microbatches, self.virtual_pipeline_size
            rank_zero_info(describe_schedule(self.pipeline_schedule, layout.pp, microbatches, chunks))
        crossing = layout.tp_groups_across_nodes()
        if crossing:
            rank_zero_warn(
                f"tensor-parallel groups span nodes (e.g. ranks {crossing[0]}): tensor_parallel_size="
                f"{layout.tp} does not divide the {layout.devices_per_node} devices per node, so TP traffic "
                "leaves the fast intra-node link. This works but is slow."
            )

    # ------------------------------------------------------------------ the model hand-off

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Modules the strategy splits are built empty (meta) and get their weights in `setup`, after being split;
        # one that parallelises itself is built as under `ModelParallelStrategy` (so its random init is the same).
        splits = hasattr(self.lightning_module, "tensor_parallel_plan")
        device = torch.device("meta") if empty_init or (splits and empty_init is None) else nullcontext()
        with device, self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if follows_plan(module):
            self.model = self.precision_plugin.convert_module(self.model)
            self.parallelize(module)
        elif is_overridden("configure_model", module):
            _materialize_distributed_module(self.model, self.root_device)
            self.model = self.precision_plugin.convert_module(self.model)
        else:
            raise TypeError(
                f"{type(self).__name__} parallelises modules that have `model.blocks` and a `tensor_parallel_plan` "
                f"(like lit3d.GPT); {type(module).__name__} has neither, so override `configure_model` and "
                "parallelise it there with `self.device_mesh`"
            )
        self.model_to_device()
        if self.layout.replicas > 1:  # before any step: replicas that are not kept in sync would silently drift
            chunks = tuple(self.pipeline.chunks) if self.pipeline is not None else ()
            check_replicas_in_sync(module, self.replica_mesh["dp"], chunks)
        # NOTE: Lightning's precision plugins clip by the norm over this process's parameters; a split model
        # needs the norm reduced over every shard and stage.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            if not any(isinstance(callback, StopOnSignal) for callback in trainer.callbacks):
                trainer.callbacks.append(StopOnSignal())  # SIGTERM / SIGUSR1: agree, save, exit to be requeued
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            if self.layout.world_size > 1:
                held = (self.precision, self.zero_stage, self._ddp, self.mixed_precision_reduce, self.layout.replicas)
                rank_zero_info(describe(*held))
            self.plan = self.planned()
            if self.plan is not None:
                self.memory_estimate = self.plan.memory_by_stage[self.layout.coordinate(self.global_rank).p]
                sizes = ", ".join(f"{key} {value / 2**20:.1f} MiB" for key, value in self.memory_estimate.items())
                rank_zero_info(f"lit3d plan estimate for rank 0: {sizes}")

    @override
    def model_to_device(self) -> None:
        module = self.lightning_module
        if self._parallelized is None or module is None:
            return super().model_to_device()
        # NOTE: the split network already lives on this device, and moving DTensor parameters swaps them under the
        # optimizer's views and the pipeline's stages: move only what else the module holds.
        for child in module.children():
            if child is not self._parallelized:
                child.to(self.root_device)

    @property
    def replica_mesh(self) -> DeviceMesh:
        """``(pp, dp, tp)``: the mesh the weights are split and synced over; its ``dp`` is the ``dp x cp`` ranks
        that hold the same weights (`device_mesh` itself without context parallelism)."""
        assert self._replica_mesh is not None, "the mesh is built in setup_environment"
        return self._replica_mesh

    @property
    def precision(self) -> str:
        """Lightning's precision setting of this run (``"32-true"``, ``"bf16-mixed"``, ...)."""
        return str(getattr(self.precision_plugin, "precision", "32-true"))

    @property
    def _ddp(self) -> bool:
        """Whether ZeRO-0 is PyTorch's DDP here (see `lit3d.strategies.precision.uses_ddp`)."""
        data_parallel_only = self.layout.tp == self.layout.pp == self.layout.ep == 1  # DDP takes no DTensor
        return uses_ddp(self.zero_stage, data_parallel_only, self.precision, self.mixed_precision_reduce)

    def parallelize(self, module: LightningModule) -> None:
        """Split ``module.model`` over the mesh (see `parallelize_network`), then give it its weights."""
        network, layout = module.model, self.layout
        if self._parallelized is network:
            return  # a later call in the same processes (fit, then validate or test): it is split already
        if getattr(network, "_lit3d_split", False):
            raise RuntimeError(
                f"{type(module).__name__}.model was split by another Parallel3DStrategy; a new "
                "strategy needs a new model (load the weights from a checkpoint)"
            )
        self._parallelized = network
        network._lit3d_split = layout.world_size > 1  # 1x1x1 leaves it as it is
        chunks, stage_ids = parallelize_network(
            network, module.tensor_parallel_plan, layout, self.replica_mesh, self.global_rank,
            zero_stage=self.zero_stage, sequence_parallel=self.sequence_parallel,
            virtual_pipeline_size=self.virtual_pipeline_size, pipeline_schedule=self.pipeline_schedule,
            activation_checkpointing=self.activation_checkpointing, compile=self.compile,
            mp_policy=mixed_precision_policy(self.precision, self.mixed_precision_reduce),
            ddp=self._ddp, expert_mesh=self._expert_mesh, ep_group=self._ep_group, cp_group=self._cp_group,
        )  # fmt: skip
        if layout.cp > 1:  # each rank's share of the batch's sequences
            route_context_parallel(module, layout.cp, layout.cp_rank(self.global_rank))
        if any(p.is_meta for p in network.parameters()):
            for chunk in chunks:
                chunk.to_empty(device=self.root_device)
            network.tie_weights()
            network.reset_parameters()
        if layout.pp > 1:
            self.pipeline = Pipeline(
                chunks, stage_ids, layout.pp * self.virtual_pipeline_size, self.device_mesh["pp"],
                self.pipeline_schedule, self.num_microbatches, self.root_device, loss_parallel=layout.tp > 1,
                split_backward=not self.activation_checkpointing,
            )  # fmt: skip
            # NOTE: fp16's loss scale multiplies the loss inside the schedule, whose backward is the only one; the
            # precision plugin unscales the gradients before the optimizer step as usual.
            self.pipeline.route(module, grad_scaler=lambda: getattr(self.precision_plugin, "scaler", None))

    # ------------------------------------------------------------------ what the planner expects of this run

    def planned(self) -> Plan | None:
        """The planner's estimate of this run's memory and communication (a lit3d GPT only; see `plan_of_run`)."""
        from lit3d.planner.run import plan_of_run

        return plan_of_run(self)

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer states (see `lit3d.strategies.memory`)."""
        return memory_by_component(self.lightning_module, self.optimizers)
