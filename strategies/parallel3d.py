"""`Parallel3DStrategy`: data × tensor × pipeline parallelism with ZeRO, as a Lightning strategy.

A Strategy owns *where* things run. This one builds the ``(pp, dp, tp)`` device mesh, then hands the
LightningModule's network to PyTorch's distributed building blocks in one place and a fixed order:

    tensor parallel (DTensor) → activation checkpointing → compile → data parallel / ZeRO (FSDP2; DDP for
    ZeRO-0 when data parallelism is the only axis)

and only then gives the empty (meta-device) network its weights, shard by shard, from the seed and the
parameter names: the weights do not depend on the layout.

A LightningModule is parallelised by the strategy when it has a ``model`` with ``blocks`` (a ModuleDict of
decoder blocks, like `lit3d.model.Transformer`) and a ``tensor_parallel_plan`` (module name pattern → role,
see `strategies.tensor_parallel`). Any other module overrides ``configure_model`` and parallelises itself
with ``self.device_mesh``, as with Lightning's ``ModelParallelStrategy``.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn as nn
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _set_num_threads_if_needed,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states, reset_seed
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lit3d.model import loss_parallel_scope
from strategies import checkpoint as ckpt
from strategies.grad_norm import clip_grad_norm_
from strategies.layout import (
    SCHEDULES,
    Layout,
    check_model_fits_layout,
    check_model_fits_pipeline,
    check_pipeline_arguments,
    check_sizes,
    default_microbatches,
    resolve_layout,
)
from strategies.memory import memory_by_component
from strategies.pipeline import Pipeline, bubble_theory, split_into_stages
from strategies.recompute import apply_activation_checkpointing, check_setting
from strategies.tensor_parallel import apply_tensor_parallel, check_plan, lay_out_grads_like_params
from strategies.zero import ELEMENTWISE_OPTIMIZERS, LocalShardOptimizer, apply_data_parallel

if TYPE_CHECKING:
    from lit3d.planner.estimate import Plan

log = logging.getLogger(__name__)
_LAUNCHER_PID = "LIT3D_LAUNCHER_PID"


class Parallel3DStrategy(ParallelStrategy):
    """Data × tensor × pipeline parallel training with ZeRO sharding; ``world = dp × tp × pp``.

    Args:
        data_parallel_size: Replicas of the model, each fed its share of the global batch; ``"auto"`` uses
            every rank that tensor and pipeline parallelism leave.
        tensor_parallel_size: Ranks that split every layer (heads, MLP width, vocabulary). Keep it within a
            node: it communicates twice per layer.
        pipeline_parallel_size: Ranks that split the depth into stages of consecutive blocks.
        zero_stage: Sharding over the data-parallel ranks: 0 nothing (DDP); 1 optimizer states; 2 and
            gradients; 3 and parameters (gathered block by block).
        sequence_parallel: Between tensor-parallel regions, keep activations (norms, residual stream) split
            along the sequence: less activation memory, same communication volume.
        pipeline_schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` or ``zero_bubble``.
        num_microbatches: Micro-batches each replica's batch is split into for the pipeline (default: 2 x
            pipeline_parallel_size).
        virtual_pipeline_size: Model chunks per pipeline rank (interleaved schedules).
        activation_checkpointing: Recompute activations in backward instead of storing them: ``True`` or
            ``"full"`` keeps only each block's input; ``"selective"`` keeps matmul, attention and collective
            outputs and recomputes the elementwise ops (see `strategies.recompute`).
        compile: ``torch.compile`` each block (``True``: inductor; a string names another backend).
        process_group_backend: ``nccl`` or ``gloo``; default picks by device (NCCL on GPUs, gloo on CPU).
        timeout: How long a collective may wait for a peer before the job fails.
        start_method: How local ranks are started when nothing else starts them (torchrun and SLURM do):
            ``"popen"`` re-runs the script per rank (Lightning's default); ``"fork"`` forks the current process,
            the only way from a Jupyter notebook. ``None`` picks ``"fork"`` in a notebook, else ``"popen"``.
    """

    strategy_name = "3d"

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        zero_stage: int = 1,
        sequence_parallel: bool = False,
        pipeline_schedule: str = "1f1b",
        num_microbatches: int | None = None,
        virtual_pipeline_size: int | None = None,
        activation_checkpointing: bool | Literal["full", "selective"] = False,
        compile: bool | str = False,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=10),
        start_method: Literal["popen", "fork"] | None = None,
    ) -> None:
        super().__init__()
        check_sizes(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                    pipeline_parallel_size=pipeline_parallel_size)
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
        if pipeline_schedule not in SCHEDULES:
            raise ValueError(f"pipeline_schedule={pipeline_schedule!r} is not one of {', '.join(SCHEDULES)}")
        if sequence_parallel and tensor_parallel_size == 1:
            rank_zero_warn("sequence_parallel=True does nothing with tensor_parallel_size=1")
        check_pipeline_arguments(pipeline_parallel_size, pipeline_schedule, num_microbatches, virtual_pipeline_size)
        check_setting(activation_checkpointing)
        if start_method not in (None, "popen", "fork"):
            raise ValueError(f"start_method={start_method!r} is not one of 'popen', 'fork' (or None: automatic)")
        if start_method == "popen" and _interactive():
            raise ValueError("start_method='popen' cannot start ranks from a notebook or an interactive session: "
                             "use start_method='fork' (or leave it unset), or run a script")
        self.start_method = start_method or ("fork" if _interactive() else "popen")
        self._sizes = (data_parallel_size, tensor_parallel_size, pipeline_parallel_size)
        self.zero_stage = zero_stage
        self.sequence_parallel = sequence_parallel and tensor_parallel_size > 1
        self.pipeline_schedule = pipeline_schedule
        self._num_microbatches = num_microbatches  # None: chosen from the per-replica batch (see check_configuration)
        self.num_microbatches = num_microbatches or 2 * pipeline_parallel_size * (virtual_pipeline_size or 1)
        self.virtual_pipeline_size = virtual_pipeline_size or 1
        self.activation_checkpointing = activation_checkpointing
        self.compile = compile
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._layout: Layout | None = None
        self._device_mesh: DeviceMesh | None = None
        self._local_optimizers: dict[int, LocalShardOptimizer] = {}
        self.pipeline: Pipeline | None = None  # this rank's stages and schedule, when pipeline_parallel_size > 1
        self._parallelized: nn.Module | None = None  # the network this strategy split
        self.plan: Plan | None = None  # the planner's estimate of this run (a lit3d GPT only), set at fit start
        self.memory_estimate: dict[str, int] | None = None  # the planner's bytes for this rank's stage
        self.num_nodes = 1

    # ------------------------------------------------------------------ where things run

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def layout(self) -> Layout:
        """Sizes and rank coordinates (checked against the number of launched ranks)."""
        if self._layout is None:
            self._layout = resolve_layout(self.num_nodes * self.num_processes, self.num_processes, *self._sizes)
        return self._layout

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``(pp, dp, tp)`` mesh; ``device_mesh["tp"]`` etc. give this rank's groups."""
        if self._device_mesh is None:
            raise RuntimeError("the device mesh exists once the processes have started (setup_environment)")
        return self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Data is split over DP replicas only: all TP and PP ranks of a replica see the same batch.
        return {"num_replicas": self.layout.dp, "rank": self.layout.coordinate(self.global_rank).d}

    @property
    def is_distributed(self) -> bool:
        return True  # also makes Lightning inject a DistributedSampler into plain dataloaders

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _ForkLauncher(self) if self.start_method == "fork" else _CheckingLauncher(self)

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
        if layout.pp > 1 and hasattr(datamodule, "global_batch_size"):
            accumulate = trainer.accumulate_grad_batches
            per_replica = datamodule.global_batch_size // (layout.dp * accumulate)
            if self._num_microbatches is None:
                self.num_microbatches = default_microbatches(per_replica, layout.pp, self.virtual_pipeline_size,
                                                             self.pipeline_schedule)
            if per_replica % self.num_microbatches:
                raise ValueError(
                    f"the per-replica batch of {per_replica} (global_batch_size={datamodule.global_batch_size} / "
                    f"(data_parallel_size={layout.dp} x accumulate_grad_batches={accumulate})) is not divisible by "
                    f"num_microbatches={self.num_microbatches}"
                )

    def setup_environment(self) -> None:
        super().setup_environment()
        self.check_configuration()
        _exit_when_launcher_dies()
        _set_num_threads_if_needed(self.num_processes)  # CPU ranks share the cores (torchrun sets 1)
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)
        _agree_on_seed()
        layout = self.layout
        self._device_mesh = init_device_mesh(
            self.root_device.type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp")
        )
        self.lightning_module._device_mesh = self._device_mesh  # for modules that parallelise themselves
        rank_zero_info(layout.rank_map())
        crossing = layout.tp_groups_across_nodes()
        if crossing:
            rank_zero_warn(
                f"tensor-parallel groups span nodes (e.g. ranks {crossing[0]}): tensor_parallel_size="
                f"{layout.tp} does not divide the {layout.devices_per_node} devices per node, so TP traffic "
                "leaves the fast intra-node link. This works but is slow."
            )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ the model hand-off

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Modules are built empty (meta) and get their weights in `setup`, after being split.
        device = nullcontext() if empty_init is False else torch.device("meta")
        with device, self.precision_plugin.tensor_init_context():
            yield

    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if _follows_plan(module):
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
        # NOTE: Lightning's precision plugins clip by the norm over this process's parameters; a split model
        # needs the norm reduced over every shard and stage.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            self.plan = self.planned()
            if self.plan is not None:
                self.memory_estimate = self.plan.memory_by_stage[self.layout.coordinate(self.global_rank).p]
                rank_zero_info("lit3d plan estimate for rank 0: " + ", ".join(
                    f"{key} {value / 2**20:.1f} MiB" for key, value in self.memory_estimate.items()))

    def parallelize(self, module: LightningModule) -> None:
        """Split ``module.model`` over the mesh (see `parallelize_network`), then give it its weights."""
        network, layout = module.model, self.layout
        if self._parallelized is network:
            return  # a later call in the same processes (fit, then validate or test): it is split already
        if getattr(network, "_lit3d_split", False):
            raise RuntimeError(f"{type(module).__name__}.model was split by another Parallel3DStrategy; a new "
                               "strategy needs a new model (load the weights from a checkpoint)")
        self._parallelized = network
        network._lit3d_split = layout.dp * layout.tp * layout.pp > 1  # 1x1x1 leaves it as it is
        chunks, stage_ids = parallelize_network(
            network, module.tensor_parallel_plan, layout, self.device_mesh, self.global_rank,
            zero_stage=self.zero_stage, sequence_parallel=self.sequence_parallel,
            virtual_pipeline_size=self.virtual_pipeline_size,
            activation_checkpointing=self.activation_checkpointing, compile=self.compile,
        )
        if any(p.is_meta for p in network.parameters()):
            for chunk in chunks:
                chunk.to_empty(device=self.root_device)
            network.tie_weights()
            network.reset_parameters()
        if layout.pp > 1:
            self.pipeline = Pipeline(chunks, stage_ids, layout.pp * self.virtual_pipeline_size, self.device_mesh["pp"],
                                     self.pipeline_schedule, self.num_microbatches, self.root_device,
                                     loss_parallel=layout.tp > 1)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup_optimizers(self, trainer: Trainer) -> None:
        self._reset_optimizers_and_schedulers()  # a second setup (e.g. fit after fit) re-wraps the model
        super().setup_optimizers(trainer)
        zero1 = self.zero_stage == 1 and self.layout.dp > 1
        self._local_optimizers = {
            id(opt): LocalShardOptimizer(opt, zero1)
            for opt in self.optimizers
            if zero1 or (isinstance(opt, ELEMENTWISE_OPTIMIZERS) and _has_dtensor_params(opt))
        }

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        local = self._local_optimizers.get(id(optimizer))
        if local is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_scatter() -> Any:  # Lightning's closure: forward, backward (gradient clipping follows)
            result = closure()
            local.scatter_grads()
            return result

        result = super().optimizer_step(optimizer, closure_then_scatter, model, **kwargs)
        local.gather_params()
        return result

    # ------------------------------------------------------------------ a training step

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if self.pipeline is not None:
            self._log_pipeline_activity()
        return output

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

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.layout.tp > 1:
            lay_out_grads_like_params(self.lightning_module.parameters())

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient communication on the micro-steps of an accumulation window but the last."""
        from torch.distributed._composable.replicate import DDP
        from torch.distributed.fsdp import FSDPModule

        # NOTE: under pipeline parallelism the schedule itself syncs once per step, after its micro-batches.
        modules = [] if self.pipeline is not None else list(self.lightning_module.modules())
        ddp = [m for m in modules if isinstance(m, DDP)]
        units = [m for m in modules if isinstance(m, FSDPModule)]
        for module in ddp:
            module.set_requires_gradient_sync(False)
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
            if self.zero_stage == 2:  # parameters are gathered once per step anyway: keep them till the last
                unit.set_reshard_after_backward(False, recurse=False)
        try:
            yield
        finally:
            for module in ddp:
                module.set_requires_gradient_sync(True)
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)
                if self.zero_stage == 2:
                    unit.set_reshard_after_backward(True, recurse=False)

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        pipeline_group = self.device_mesh["pp"].get_group() if self.layout.pp > 1 else None
        clip_grad_norm_(self.lightning_module.parameters(), clip_val, pipeline_group)

    def _log_pipeline_activity(self) -> None:
        """Each stage's busy time, and the measured idle share of the step next to the schedule's theory."""
        clock, pipeline = self.pipeline.clock, self.pipeline
        mine = torch.tensor([clock.busy(), clock.step_seconds()], device=self.root_device)
        every = torch.empty(self.layout.pp * 2, device=self.root_device)
        torch.distributed.all_gather_single(every, mine, group=pipeline.group)
        busy, step = every.view(-1, 2).unbind(1)
        log = self.lightning_module.log
        for p, seconds in enumerate(busy.tolist()):
            log(f"pp/stage{p}_busy_s", seconds, on_step=True, rank_zero_only=True, batch_size=1)
        log("pp/step_s", step.max().item(), on_step=True, rank_zero_only=True, batch_size=1)
        log("pp/bubble", 1 - (busy / step.max()).mean().item(), on_step=True, prog_bar=False, rank_zero_only=True,
            batch_size=1)
        log("pp/bubble_theory", bubble_theory(self.pipeline_schedule, self.layout.pp, self.num_microbatches,
                                              self.virtual_pipeline_size), on_step=True, rank_zero_only=True,
            batch_size=1)

    # ------------------------------------------------------------------ collectives Lightning asks for

    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        objects = [obj]
        torch.distributed.broadcast_object_list(objects, src, group=_group.WORLD)
        return objects[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """All-reduce over all ranks (TP and PP ranks of a replica hold equal values, so a mean is the DP mean)."""
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints (see strategies.checkpoint)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.lightning_module.state_dict()  # DTensor shards under layout-free names

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
        names = ckpt.parameter_names(self.lightning_module)
        local = self._local_optimizers.get(id(optimizer))
        if local is None:
            return ckpt.optimizer_state_by_name(optimizer, names)
        # Name each view after its parameter, and give its states their place in the global tensor.
        names.update({id(e.view): names[id(e.param)] for e in local.entries})
        return ckpt.optimizer_state_by_name(optimizer, names, local.as_global)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} writes sharded checkpoints itself; storage_options is not supported")
        path = Path(self.broadcast(str(filepath)))
        tensors = {"state_dict": checkpoint.pop("state_dict"), "optimizer_states": checkpoint.pop("optimizer_states", [])}
        checkpoint["rng"] = _collect_rng_states()  # rank 0's; every rank was seeded alike
        ckpt.save(path, tensors, checkpoint, self.is_global_zero)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        ckpt.check_readable(path)
        tensors: dict[str, Any] = {"state_dict": self.lightning_module.state_dict()}
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING and self.optimizers:
            for optimizer in self.optimizers:
                ckpt.init_optimizer_state(optimizer)
            tensors["optimizer_states"] = [self.optimizer_state(opt) for opt in self.optimizers]
        meta = ckpt.load(path, tensors)  # tensors were loaded in place; hyper-parameters come back as values
        for optimizer, loaded in zip(self.optimizers, tensors.get("optimizer_states", [])):
            ckpt.restore_param_groups(optimizer, loaded)
        if "rng" in meta:
            _set_rng_states(meta.pop("rng"))
        return meta

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # `load_checkpoint` already filled the parameters in place

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # likewise

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

    def planned(self) -> Plan | None:
        """The planner's estimate (`lit3d.planner`) of this run's memory and communication, for a lit3d GPT."""
        from lit3d.config import GPTConfig
        from lit3d.planner.estimate import RUNTIME_PRECISIONS, Cluster, Training, estimate

        module, layout = self.lightning_module, self.layout
        config = getattr(module, "config", None)
        if not isinstance(config, GPTConfig):
            return None
        trainer = module.trainer
        data = getattr(trainer, "datamodule", None)
        steps = self.num_microbatches if layout.pp > 1 else trainer.accumulate_grad_batches
        micro = max(1, getattr(data, "global_batch_size", layout.dp) // (layout.dp * steps))
        training = Training(
            seq_len=getattr(data, "seq_len", config.max_seq_len), micro_batch_size=micro,
            global_batch_size=micro * layout.dp * steps, zero_stage=self.zero_stage,
            sequence_parallel=self.sequence_parallel, activation_checkpointing=self.activation_checkpointing,
            pipeline_schedule=self.pipeline_schedule, virtual_pipeline_size=self.virtual_pipeline_size,
        )
        precision = RUNTIME_PRECISIONS.get(str(trainer.precision), RUNTIME_PRECISIONS["32-true"])
        cluster = Cluster(nodes=self.num_nodes, gpus_per_node=self.num_processes)
        return estimate(config, cluster, layout, training, precision)

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer states (see `strategies.memory`)."""
        return memory_by_component(self.lightning_module, self.optimizers)

    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


def parallelize_network(network: nn.Module, plan: dict[str, str], layout: Layout, mesh: DeviceMesh, rank: int, *,
                        zero_stage: int, sequence_parallel: bool = False, virtual_pipeline_size: int = 1,
                        activation_checkpointing: bool | str = False, compile: bool | str = False,
                        ) -> tuple[list[nn.Module], list[int]]:
    """Split ``network`` for ``rank`` in place, in the fixed order, without giving it weights (it may stay on
    the meta device, as `lit3d plan --verify` keeps it):

    pipeline stages → tensor parallel → activation checkpointing → compile → data parallel / ZeRO.

    Returns this rank's pipeline chunks (views of ``network``) and their stage indices.
    """
    check_plan(network, plan)
    chunks, stage_ids = [network], [0]
    if layout.pp > 1:
        chunks, stage_ids = split_into_stages(network, layout.coordinate(rank).p, layout.pp, virtual_pipeline_size)
    if layout.tp > 1:
        apply_tensor_parallel(network, plan, mesh["tp"], sequence_parallel)
        network.tie_weights()  # TP distributed the shared tensor once per module
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
    if layout.dp > 1:
        for chunk in chunks:  # each pipeline chunk is a data-parallel root of its own
            apply_data_parallel(chunk, list(chunk.blocks.values()), mesh["dp"], zero_stage,
                                data_parallel_only=layout.tp == layout.pp == 1)
    return chunks, stage_ids


def _has_dtensor_params(optimizer: torch.optim.Optimizer) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])


def _follows_plan(module: LightningModule) -> bool:
    network = getattr(module, "model", None)
    return hasattr(module, "tensor_parallel_plan") and isinstance(getattr(network, "blocks", None), nn.ModuleDict)


def _datamodule_among(args: tuple) -> LightningDataModule | None:
    """The datamodule `Trainer.fit` (validate, ...) hands its launcher: attached to the trainer only in the ranks."""
    return next((arg for arg in args if isinstance(arg, LightningDataModule)), None)


class _ChecksFirst:
    """For our launchers: check the configuration before any rank starts, then let the ranks watch this process
    (they end if it dies; see `_exit_when_launcher_dies`)."""

    _strategy: Parallel3DStrategy

    def launch(self, function: Any, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        self._strategy.check_configuration(trainer, _datamodule_among(args))
        os.environ[_LAUNCHER_PID] = str(os.getpid())
        return super().launch(function, *args, trainer=trainer, **kwargs)


class _CheckingLauncher(_ChecksFirst, _SubprocessScriptLauncher):
    """Lightning's script launcher, but the configuration is checked before any child process starts."""

    def __init__(self, strategy: Parallel3DStrategy) -> None:
        super().__init__(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
        self._strategy = strategy


class _ForkLauncher(_ChecksFirst, _MultiProcessingLauncher):
    """Forks the ranks from the current process, as Lightning's ``ddp_notebook`` does: works in Jupyter.

    The configuration is checked before forking. Metrics (``trainer.callback_metrics``) and the best checkpoint
    path come back to the notebook; the weights stay sharded in the ranks, so save a checkpoint to keep them.
    """

    def __init__(self, strategy: Parallel3DStrategy) -> None:
        super().__init__(strategy, start_method="fork")

    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> _WorkerOutput | None:
        if self._strategy.local_rank != 0:
            return None
        best = getattr(trainer.checkpoint_callback, "best_model_path", None)
        return _WorkerOutput(best, None, trainer.state, results, self.get_extra_results(trainer))


def _interactive() -> bool:
    """A notebook or a Python prompt (Lightning's test): script launchers cannot re-run it per rank."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive)


def _agree_on_seed() -> None:
    """Take rank 0's seed on every rank if they were seeded apart (no ``seed_everything``): the weights come from
    the seed (`Transformer.reset_parameters`), and replicas that start apart would stay apart."""
    import torch.distributed as dist

    seeds: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(seeds, torch.initial_seed())
    if len(set(seeds)) > 1:
        rank_zero_warn(f"the ranks were seeded differently ({len(set(seeds))} seeds; call `seed_everything`): "
                       f"every rank now uses rank 0's seed {seeds[0]}, so all start from the same weights")
        torch.manual_seed(seeds[0])


def _exit_when_launcher_dies() -> None:
    """In a process our launcher started: exit if the launcher (rank 0) dies, rather than wait in a collective.

    Lightning already ends every rank when a child fails; this covers the other direction.
    """
    launcher = os.environ.get(_LAUNCHER_PID)
    if launcher is None or int(launcher) == os.getpid() or os.getppid() != int(launcher):
        return

    def watch() -> None:
        while os.getppid() == int(launcher):
            time.sleep(1.0)
        log.error(f"rank 0 (pid {launcher}) has exited; ending this rank (pid {os.getpid()})")
        os._exit(1)

    threading.Thread(target=watch, name="lit3d-launcher-watch", daemon=True).start()
