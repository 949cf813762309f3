"""`Parallelism`: every size and setting of a parallel run, as one frozen value.

The one description of a run. `lit3d.strategies.Parallel3DStrategy` is built from it (its keyword arguments are
these fields, tested to stay so), the planner (`lit3d.planner.plan`) and ``lit3d plan`` take it, and the strategy's
argument documentation, ``lit3d plan``'s flags and the docs' table are all generated from the ``help`` of each field.
`Parallelism.check` holds every rule a setting must follow on its own; the rules that also need the world size
or the model are `lit3d.parallel.layout`'s.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, replace
from datetime import timedelta
from typing import Any, Literal

from lit3d.parallel.layout import (
    Layout,
    check_choices,
    check_islands,
    check_pipeline_arguments,
    check_shard_groups,
    check_sizes,
    pipeline_microbatches,
    resolve_layout,
)
from lit3d.parallel.outer import check_outer_loop
from lit3d.parallel.precision import check_reduce_dtype
from lit3d.parallel.run_settings import check_run_settings, interactive
from lit3d.parallel.schedules import check_composes, chunks_per_rank
from lit3d.parallel.shares import check_shares
from lit3d.parallel.stages import check_stage_layers

RECOMPUTE_MODES = (
    "full",
    "selective",
)  # `activation_checkpointing`'s named choices (`lit3d.strategies.split.recompute`)


def _setting(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": " ".join(help.split())})


@dataclass(frozen=True)
class Parallelism:
    """Data × tensor × pipeline (× context, × expert) parallelism with ZeRO: ``world = dp × cp × tp × pp``."""

    data_parallel_size: int | Literal["auto"] = _setting(
        "auto",
        """Replicas of the model, each fed its share
        of the global batch; ``"auto"`` uses every rank that tensor and pipeline parallelism leave.""",
    )
    data_parallel_shard_size: int | None = _setting(
        None,
        """HSDP: ZeRO (stages 1-3) shards over groups of this many consecutive data-parallel ranks, and the groups
        are replicas that all-reduce the shards' gradients once per step, so the per-layer gathers stay on the fast
        links and one reduction crosses the slow ones. ``None``: one group of all of them.""",
    )
    tensor_parallel_size: int | Literal["auto"] = _setting(
        "auto",
        """Ranks that split every layer (heads, MLP width, vocabulary). Keep it within a node: it communicates twice
        per layer. ``"auto"``: 1 for a module lit3d splits (like `lit3d.GPT`: tensor parallelism when asked), and the
        devices of a node for a module that parallelises itself in ``configure_model`` (Lightning's
        ``ModelParallelStrategy`` convention, whose defaults then give its very mesh).""",
    )
    pipeline_parallel_size: int = _setting(1, "Ranks that split the depth into stages of consecutive blocks.")
    data_parallel_shares: list[int] | None = _setting(
        None,
        """The samples of each global batch each data-parallel replica computes, in replica order (summing to the
        global batch; each a whole number of its micro-batches): more on faster GPUs. Each replica's loss is weighted
        by its share, so a step is the single-process step on the same global batch. ``None``: even shares.""",
    )
    expert_parallel_size: int = _setting(
        1,
        """Ranks that split each Mixture-of-Experts layer's experts,
        borrowed from data parallelism (it divides ``data_parallel_size``; tokens reach their experts by
        all-to-all).""",
    )
    context_parallel_size: int = _setting(
        1,
        """Ranks that split every sequence (long contexts): each holds two
        of ``2 x cp`` chunks, attention is a ring over them, and the weights are synced and ZeRO-sharded over the
        ``dp x cp`` ranks. The mesh is ``(pp, dp, cp, tp)``.""",
    )
    zero_stage: int = _setting(
        1,
        """Sharding over the data-parallel ranks: 0 nothing (DDP); 1 optimizer
        states, the gradients reduce-scattered at the step (DDP's bytes); 2 and parameters between steps
        (gathered once per step); 3 and parameters gathered block by block.""",
    )
    accumulate_unsharded: bool = _setting(
        False,
        """``True``: under gradient accumulation, keep the gradients whole on every rank until the window's last
        micro-step (ZeRO-2/3: one reduce-scatter per step, for the memory of the whole gradients). ``False``:
        reduce-scatter them at every micro-step, so they accumulate as shards, 1/dp of them per rank (as FSDP2 and
        torchtitan do). A pipeline's micro-batches sum whole within a schedule either way (PyTorch's
        ``PipelineStage``).""",
    )
    offload: bool = _setting(
        False,
        """ZeRO-3 only: keep the sharded parameters, their gradients and the optimizer states in CPU memory (FSDP2's
        ``CPUOffloadPolicy``); each block's weights travel to the device for its forward and backward, and the
        optimizer steps on the CPU. For models whose states do not fit the devices, at the price of host transfers
        and a CPU optimizer step.""",
    )
    sequence_parallel: bool = _setting(
        False,
        """Between tensor-parallel regions, keep activations (norms,
        residual stream) split along the sequence: 1/t of the layer's activations for one more all-gather per
        region in backward.""",
    )
    pipeline_schedule: str = _setting(
        "1f1b",
        """``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zero_bubble``
        (backward split into input and weight gradients, the latter filling the bubbles), ``zbv`` (zero bubble
        over two chunks per rank in a V) or ``dualpipev`` (DeepSeek's DualPipe-V); their bubbles and memory:
        `lit3d.parallel.schedules`.""",
    )
    num_microbatches: int | None = _setting(
        None,
        """Micro-batches each replica's batch is split into for the
        pipeline (default: the most, up to 2 x pipeline_parallel_size x virtual_pipeline_size, that divide the
        per-replica batch).""",
    )
    virtual_pipeline_size: int | None = _setting(
        None,
        """Model chunks per pipeline rank (interleaved
        schedules, default 2; ``zbv`` and ``dualpipev`` run 2).""",
    )
    pipeline_stage_layers: list[int] | None = _setting(
        None,
        """The blocks of each pipeline stage, in order (``pipeline_parallel_size`` x chunks per rank of them, summing to
        the model's blocks): more on faster or larger GPUs. The embedding stays on the first stage and the head on
        the last, which may hold no block (0). ``None``: stages balanced by cost.""",
    )
    activation_checkpointing: bool | Literal["full", "selective"] = _setting(
        False,
        """Recompute activations
        in backward instead of storing them: ``True`` or ``"full"`` keeps only each block's input;
        ``"selective"`` keeps matmul, attention and collective outputs and recomputes the elementwise ops.""",
    )
    compile: bool | str = _setting(
        False,
        """``torch.compile`` each block (``True``: inductor; a string names
        another backend).""",
    )
    mixed_precision_reduce: Literal["float32", "bfloat16"] = _setting(
        "float32",
        """Under
        ``precision="bf16-mixed"``, the dtype gradients are reduced in over DP: ``"float32"`` (torchtitan's
        default) or ``"bfloat16"`` (half the bytes). Parameters are gathered in bf16 either way.""",
    )
    float8: Literal["tensorwise", "rowwise"] | None = _setting(
        None,
        """Run the matmuls of the blocks' linears in FP8 (torchao's float8 training, dynamic scales):
        ``"tensorwise"`` (a scale per tensor) or ``"rowwise"`` (a scale per row, more accurate, slower); the
        embedding, head, router and MoE experts stay in bf16. Needs ``precision="bf16-mixed"`` or
        ``"bf16-true"``.""",
    )
    float8_all_gather: bool = _setting(
        False,
        """With ``float8="tensorwise"`` at ZeRO-2/3: gather the blocks' linear weights in FP8, half of bf16's
        bytes.""",
    )
    async_checkpoint: bool = _setting(
        False,
        """Write sharded checkpoints in the background: training waits
        only while each rank's shards are copied to host memory; the folder still appears complete or not at
        all, and a failed write is raised at the next save or at the end of training, naming the folder.""",
    )
    save_distributed_checkpoint: bool = _setting(
        True,
        """``True``: a checkpoint is a folder in which every rank writes its own shards (any layout resumes it).
        ``False``: one consolidated file, as Lightning's ``ModelParallelStrategy`` writes it, that a plain
        ``LightningModule`` loads on one device (rank 0 gathers it in its CPU memory).""",
    )
    process_group_backend: str | None = _setting(
        None,
        """``nccl`` or ``gloo``; default picks by device (NCCL
        on GPUs, gloo on CPU).""",
    )
    timeout: timedelta = _setting(
        timedelta(minutes=10),
        """How long a collective may wait for a peer before the
        job fails. At 90 % of it without progress, each rank logs the collective it waits in.""",
    )
    auto_layout: bool = _setting(
        False,
        """The planner chooses at launch (``--trainer.strategy=3d_auto``): every setting left at its default among
        the sizes, ``zero_stage``, the schedule and its micro-batches, recompute and ``sequence_parallel``, and the
        micro-batch size, from its fastest plan that fits this cluster, model and data; rank 0 logs the choice and its
        flags.""",
    )
    auto_memory_gb: float | None = _setting(
        None,
        """With ``auto_layout``: the memory each rank may hold (GB), in place of the device's.""",
    )
    plan_profile: str | None = _setting(
        None,
        """A profile of this machine that ``lit3d calibrate`` wrote (JSON), on which every run's plan check
        (``plan/step_time_ratio``) prices its step. On GPUs the card PyTorch reports is priced; on CPU ranks without
        a profile the step time is not compared (the memory is).""",
    )
    start_method: Literal["popen", "fork"] | None = _setting(
        None,
        """How local ranks are started when nothing
        else starts them (torchrun and SLURM do): ``"popen"`` re-runs the script per rank (Lightning's
        default); ``"fork"`` forks the current process, the only way from a Jupyter notebook. ``None`` picks
        ``"fork"`` in a notebook, else ``"popen"``.""",
    )
    islands: int = _setting(
        1,
        """DiLoCo: the data-parallel replicas split into this many islands of
        consecutive ranks, each a whole ``dp x tp x pp`` layout that syncs every step inside itself; islands
        communicate only at the outer step. ``data_parallel_size`` counts the replicas of all islands.""",
    )
    sync_every: int = _setting(
        1,
        """Inner steps between DiLoCo's outer steps (``H``). DiLoCo runs when
        ``islands > 1`` or ``sync_every > 1``.""",
    )
    outer_lr: float = _setting(0.7, "The outer SGD's learning rate (DiLoCo's 0.7).")
    outer_momentum: float = _setting(0.9, "The outer SGD's Nesterov momentum (DiLoCo's 0.9; 0 for none).")
    outer_fragments: int = _setting(
        1,
        """Streaming DiLoCo: the weights are synced in this many fragments at
        staggered inner steps, each once every ``sync_every`` steps.""",
    )
    outer_reduce_dtype: Literal["float32", "bfloat16"] = _setting(
        "float32",
        """The dtype the pseudo-gradients
        travel between islands in: ``"float32"`` or ``"bfloat16"`` (half the bytes).""",
    )
    replica_groups: int | None = _setting(
        None,
        """Fault tolerance (torchft): this many copies of the layout, each a job of its
        own (``REPLICA_GROUP_ID``), average gradients over the groups that take part in each step (with
        ``sync_every > 1``: each group is a DiLoCo island, the pseudo-gradients averaged at the outer steps); a failed
        group is dropped and rejoins from a live one (docs/fault-tolerance.md). ``None``: one job, no lighthouse.""",
    )

    def __post_init__(self) -> None:
        for name in ("pipeline_stage_layers", "data_parallel_shares"):  # tuples: the planner's caches hash settings
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        self.check()

    def check(self) -> None:
        """Refuse settings that no run could use, naming the values (before any process starts)."""
        check_sizes(**self.sizes())
        check_choices(self.zero_stage, self.pipeline_schedule)
        self._check_sized(self.pipeline_parallel_size, self.data_parallel_size)
        check_recompute(self.activation_checkpointing)
        dp = self.data_parallel_size  # (of an island: the shard groups split an island's replicas)
        check_shard_groups(self.data_parallel_shard_size, dp if dp == "auto" else dp // self.islands, self.zero_stage)
        if self.offload not in (False, True) or (self.offload and self.zero_stage != 3):
            raise ValueError(
                f"offload={self.offload!r} with zero_stage={self.zero_stage}: offloading to the CPU needs zero_stage=3 "
                "(FSDP2 keeps the sharded states it offloads)"
            )
        if self.offload and self.expert_parallel_size != 1:
            raise ValueError(
                f"offload=True with expert_parallel_size={self.expert_parallel_size}: experts split over "
                "ranks are not offloaded yet; offload without expert parallelism"
            )
        check_reduce_dtype(self.mixed_precision_reduce)
        self._check_float8()
        check_outer_loop(
            self.islands,
            self.sync_every,
            self.outer_lr,
            self.outer_momentum,
            self.outer_fragments,
            self.outer_reduce_dtype,
        )
        check_run_settings(self)

    def _check_float8(self) -> None:
        if self.float8 not in (None, "tensorwise", "rowwise"):
            raise ValueError(f"float8={self.float8!r} is not one of None, 'tensorwise', 'rowwise'")
        if self.float8_all_gather not in (False, True):
            raise ValueError(f"float8_all_gather={self.float8_all_gather!r} must be True or False")
        if self.float8_all_gather and self.float8 != "tensorwise":
            raise ValueError(
                f"float8_all_gather=True with float8={self.float8!r}: FP8 gathers need "
                "float8='tensorwise' (one scale per weight, computed before the gather)"
            )
        if self.float8_all_gather and self.zero_stage < 2:
            raise ValueError(
                f"float8_all_gather=True with zero_stage={self.zero_stage}: the weights are gathered by "
                "FSDP2 at zero_stage 2 or 3"
            )

    def sizes(self, devices_per_node: int | None = None, lit3d_splits: bool = True) -> dict[str, int | str]:
        """The axes' sizes by their argument names (what `lit3d.parallel.layout.resolve_layout` takes). Given the
        ``devices_per_node``, ``tensor_parallel_size="auto"`` is resolved: 1 for a module lit3d splits
        (``lit3d_splits``), else the devices of a node, as Lightning's ``ModelParallelStrategy`` does."""
        tp = self.tensor_parallel_size
        if tp == "auto" and devices_per_node is not None:
            tp = 1 if lit3d_splits else devices_per_node
        return {
            "data_parallel_size": self.data_parallel_size,
            "tensor_parallel_size": tp,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "expert_parallel_size": self.expert_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "data_parallel_shard_size": self.data_parallel_shard_size,
        }

    def resolve(self, world_size: int, devices_per_node: int, lit3d_splits: bool = True) -> Layout:
        """The `Layout` these sizes give on ``world_size`` ranks, ``"auto"`` resolved (`sizes`) and every rule that
        needs the resolved sizes checked. From here on the layout owns the sizes: nothing downstream reads them from
        a `Parallelism`."""
        sizes = self.sizes(devices_per_node, lit3d_splits)
        layout = resolve_layout(world_size, devices_per_node, **sizes, islands=self.islands)
        self.check_layout(layout)
        return layout

    def check_layout(self, layout: Layout) -> None:
        """Refuse these settings on ``layout`` where they need its sizes: the schedule against the pipeline and the ZeRO
        stage, the blocks per stage against the stages, the shares against the replicas, the islands against them."""
        self._check_sized(layout.pp, layout.data_replicas, layout.ep, layout.cp)

    def _check_sized(self, pp: int, replicas: int | str, ep: int | None = None, cp: int | None = None) -> None:
        """The rules that read the pipeline's size and the data-parallel replicas (``"auto"``: not known yet)."""
        check_pipeline_arguments(pp, self.pipeline_schedule, self.num_microbatches, self.virtual_pipeline_size)
        check_composes(self.pipeline_schedule, pp, self.compile, self.zero_stage)
        check_stage_layers(self.pipeline_stage_layers, None, pp * self.chunks_per_rank)
        check_shares(self.data_parallel_shares, replicas, self.islands)
        if replicas != "auto":
            ep, cp = ep or self.expert_parallel_size, cp or self.context_parallel_size
            check_islands(self.islands, replicas, ep, cp)

    def at(self, layout: Layout) -> Parallelism:
        """These settings at the sizes of ``layout`` (checked as every `Parallelism` is): the strategy's arguments that
        run it. The one way back from a `Layout` to arguments, for the planner, which writes runs."""
        return replace(
            self,
            data_parallel_size=layout.data_replicas,
            tensor_parallel_size=layout.tp,
            pipeline_parallel_size=layout.pp,
            expert_parallel_size=layout.ep,
            context_parallel_size=layout.cp,
            islands=layout.islands,
            data_parallel_shard_size=layout.dp_shard,
        )

    def warnings(self) -> list[str]:
        """Settings that are allowed but do nothing here."""
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            return ["sequence_parallel=True does nothing with tensor_parallel_size=1"]
        if self.accumulate_unsharded and self.zero_stage < 2:
            return [f"accumulate_unsharded=True does nothing at zero_stage={self.zero_stage} (ZeRO-2/3 only)"]
        if self.auto_memory_gb is not None and not self.auto_layout:
            return [f"auto_memory_gb={self.auto_memory_gb} does nothing without auto_layout=True"]
        return []

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks each pipeline rank runs (``virtual_pipeline_size`` resolved for the schedule)."""
        return chunks_per_rank(self.pipeline_schedule, self.virtual_pipeline_size)

    def splits_sequence(self, layout: Layout) -> bool:
        """Whether sequence parallelism runs on ``layout`` (it needs tensor parallelism)."""
        return self.sequence_parallel and layout.tp > 1

    @property
    def runs_outer_loop(self) -> bool:
        """Whether DiLoCo's outer loop runs (islands, or one island with ``sync_every > 1``)."""
        return self.islands > 1 or self.sync_every > 1

    def microbatches(self, global_batch_size: int | None = None, data_replicas: int = 1, accumulate: int = 1) -> int:
        """The pipeline's micro-batches per schedule: ``num_microbatches``, or chosen from the per-replica batch
        (`lit3d.parallel.layout.pipeline_microbatches`; from the settings alone while the batch is unknown)."""
        return pipeline_microbatches(
            self.num_microbatches,
            global_batch_size,
            data_replicas,
            accumulate,
            self.pipeline_parallel_size,
            self.chunks_per_rank,
            self.pipeline_schedule,
        )

    def resolved_start_method(self) -> str:
        return self.start_method or ("fork" if interactive() else "popen")


def check_recompute(activation_checkpointing: bool | str) -> None:
    """Refuse a value of ``activation_checkpointing``, naming it."""
    if activation_checkpointing not in (True, False, *RECOMPUTE_MODES):
        raise ValueError(
            f"activation_checkpointing={activation_checkpointing!r} is not one of True, False, "
            + ", ".join(map(repr, RECOMPUTE_MODES))
        )


def defaults() -> dict[str, Any]:
    """Each setting's default by name."""
    return {f.name: f.default for f in fields(Parallelism) if f.default is not MISSING}
