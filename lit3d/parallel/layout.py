"""The rank grid: sizes of the axes, each rank's coordinate, the checks and the rank map.

Ranks are laid out TP-innermost (Megatron's formula, with context parallelism between DP and TP)::

    global_rank = t + c * T + d * T * C + p * T * C * D

so a TP group is a run of T consecutive ranks, which land on one node when T divides the devices per node
(TP is the chattiest axis and wants the fastest link), a CP ring comes next; PP is outermost and crosses nodes.

CP ranks hold the same weights and see different tokens of the same sequences: for everything but attention
they are data-parallel replicas, and gradients are averaged and ZeRO shards over the ``dp × cp`` replicas (the
``replicas`` of a layout; `lit3d.strategies.meshes.ParallelMeshes`), as torchtitan does.

With DiLoCo's ``islands`` (`lit3d.strategies.optim.diloco`), the ranks split into that many islands of consecutive
ranks, each a whole ``dp × cp × tp × pp`` layout (``dp`` counts an island's replicas, which sync every step), and the
island is the outermost digit: ``global_rank = t + c·T + d·T·C + p·T·C·D + i·T·C·D·P``. The global batch is split over
all ``islands × dp`` replicas (`Layout.data_replicas`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from lit3d.parallel.schedules import DEFAULT_CHUNKS, SCHEDULES, chunks_per_rank, microbatch_problem

ZERO_STAGES = (0, 1, 2, 3)
MESH_DIMS = ("pp", "dp", "cp", "tp")  # outermost first: the order of the rank formula
# Lightning's `ModelParallelStrategy` names its mesh dims so; modules written for it index the mesh with them.
LIGHTNING_DIM_NAMES = {
    "data_parallel": "dp",
    "tensor_parallel": "tp",
    "pipeline_parallel": "pp",
    "context_parallel": "cp",
}


class Coordinate(NamedTuple):
    """A rank's place on each axis, outermost first: the order of the rank formula and of `MESH_DIMS`."""

    p: int
    d: int
    c: int
    t: int


@dataclass(frozen=True)
class Layout:
    """``dp × cp × tp × pp`` ranks, ``devices_per_node`` of them on each node."""

    dp: int
    tp: int
    pp: int
    devices_per_node: int
    ep: int = 1  # expert parallelism: MoE experts split over groups of this many consecutive DP ranks
    cp: int = 1  # context parallelism: every sequence split over this many ranks
    islands: int = 1  # DiLoCo: the layout is repeated this many times; islands sync only at the outer step
    dp_shard: int | None = None  # HSDP: ZeRO shards over groups of this many consecutive DP ranks (None: all dp)

    @property
    def grid(self) -> str:
        """The sizes as reports and logs name them: ``dp 2 x tp 2 x pp 2`` (``x cp`` with context parallelism, inside
        ``N islands x (...)`` with DiLoCo's islands)."""
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        grid = f"dp {self.dp}{cp} x tp {self.tp} x pp {self.pp}"
        return f"{self.islands} islands x ({grid})" if self.islands > 1 else grid

    @property
    def world_size(self) -> int:
        return self.islands * self.island_size

    @property
    def island_size(self) -> int:
        """Ranks of one island: ``dp × cp × tp × pp``."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def data_replicas(self) -> int:
        """Replicas the global batch is split over: ``dp`` in every island."""
        return self.islands * self.dp

    def island(self, rank: int) -> int:
        return rank // self.island_size

    def data_rank(self, rank: int) -> int:
        """This rank's replica among all `data_replicas` (its share of every global batch)."""
        return self.island(rank) * self.dp + self.coordinate(rank).d

    def island_groups(self) -> list[list[int]]:
        """The ranks DiLoCo's outer step averages over (the mesh's ``island`` dim): one group per (p, d, c, t)."""
        return [[rank + i * self.island_size for i in range(self.islands)] for rank in range(self.island_size)]

    @property
    def replicas(self) -> int:
        """Ranks that hold the same weights (same TP and PP coordinates): ``dp × cp``."""
        return self.dp * self.cp

    @property
    def shard_size(self) -> int:
        """Data-parallel ranks of one ZeRO shard group (HSDP's ``dp_shard``): all ``dp`` of them by default."""
        return self.dp_shard or self.dp

    @property
    def dp_replicate(self) -> int:
        """Shard groups that replicate one another (HSDP): they all-reduce the shards' gradients once per step."""
        return self.dp // self.shard_size

    @property
    def shard_ranks(self) -> int:
        """Ranks a ZeRO shard is split over: a shard group's ``shard_size × cp``."""
        return self.shard_size * self.cp

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.devices_per_node)

    def coordinate(self, rank: int) -> Coordinate:
        """``(p, d, c, t)`` of ``rank`` (in its island): the rank formula's digits, outermost first."""
        t, rest = rank % self.tp, rank // self.tp
        c, rest = rest % self.cp, rest // self.cp
        return Coordinate(p=rest // self.dp % self.pp, d=rest % self.dp, c=c, t=t)

    def cp_rank(self, rank: int) -> int:
        """``rank``'s place in its context-parallel ring."""
        return self.coordinate(rank).c

    def rank(self, p: int = 0, d: int = 0, c: int = 0, t: int = 0, island: int = 0) -> int:
        """The rank at ``(p, d, c, t)`` of ``island``: the rank formula."""
        return t + self.tp * (c + self.cp * (d + self.dp * (p + self.pp * island)))

    def cp_groups(self) -> list[list[int]]:
        """The context-parallel rings: ``cp`` ranks with the same p, d and t, ``tp`` apart."""
        return [
            [self.rank(p, d, c, t) for c in range(self.cp)]
            for p in range(self.pp)
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def ep_groups(self) -> list[list[int]]:
        """The expert-parallel groups: ``ep`` consecutive data-parallel ranks each (same TP, CP and PP
        coordinates)."""
        return [
            [self.rank(p, first + e, c, t) for e in range(self.ep)]
            for p in range(self.pp)
            for first in range(0, self.dp, self.ep)
            for c in range(self.cp)
            for t in range(self.tp)
        ]

    def node(self, rank: int) -> int:
        return rank // self.devices_per_node

    def tp_groups(self) -> list[list[int]]:
        return [
            [self.rank(p, d, c, t, i) for t in range(self.tp)]
            for i in range(self.islands)
            for p in range(self.pp)
            for d in range(self.dp)
            for c in range(self.cp)
        ]

    def tp_groups_across_nodes(self) -> list[list[int]]:
        """TP groups whose ranks sit on more than one node (legal, but TP traffic then leaves the fast link)."""
        return [group for group in self.tp_groups() if len({self.node(r) for r in group}) > 1]

    def tp_across_nodes_warning(self) -> str:
        """What the rank-0 log says when TP groups span nodes (`tp_groups_across_nodes`)."""
        return (
            f"tensor-parallel groups span nodes (e.g. ranks {self.tp_groups_across_nodes()[0]}): tensor_parallel_size="
            f"{self.tp} does not divide the {self.devices_per_node} devices per node, so TP traffic leaves the fast "
            "intra-node link. This works but is slow."
        )


def resolve_layout(
    world_size: int,
    devices_per_node: int,
    data_parallel_size: int | str,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
    islands: int = 1,
    data_parallel_shard_size: int | None = None,
) -> Layout:
    """Sizes checked against the world; ``data_parallel_size="auto"`` takes what TP, CP and PP leave; expert
    parallelism borrows its ranks from data parallelism, and DiLoCo's ``islands`` split the data-parallel replicas
    (``data_parallel_size`` counts all of them)."""
    tp, pp, cp = tensor_parallel_size, pipeline_parallel_size, context_parallel_size
    named = f"tensor_parallel_size={tp} x pipeline_parallel_size={pp}" + (
        f" x context_parallel_size={cp}" if cp > 1 else ""
    )
    if world_size % (tp * pp * cp):
        raise ValueError(f"{named} does not divide the {world_size} launched ranks")
    dp = world_size // (tp * pp * cp) if data_parallel_size == "auto" else data_parallel_size
    if dp * tp * pp * cp != world_size:
        raise ValueError(
            f"data_parallel_size={dp} x {named} = {dp * tp * pp * cp}, but {world_size} ranks were launched "
            "(devices x num_nodes); make them equal or use data_parallel_size='auto'"
        )
    if dp % expert_parallel_size:
        raise ValueError(
            f"expert_parallel_size={expert_parallel_size} does not divide data_parallel_size={dp}: expert "
            "parallelism splits the experts over groups of data-parallel ranks"
        )
    check_islands(islands, dp, expert_parallel_size, cp)
    shard = check_shard_groups(data_parallel_shard_size, dp // islands)
    return Layout(
        dp=dp // islands,
        tp=tp,
        pp=pp,
        devices_per_node=devices_per_node,
        ep=expert_parallel_size,
        cp=cp,
        islands=islands,
        dp_shard=shard,
    )


def check_shard_groups(shard: int | None, dp: int | str, zero_stage: int | None = None) -> int | None:
    """HSDP's shard groups of ``shard`` data-parallel ranks must split the ``dp`` replicas (of an island) evenly, and
    are ZeRO's; the layout's ``dp_shard`` (None where one group holds them all: plain ZeRO)."""
    if shard is not None and zero_stage == 0:
        raise ValueError(
            f"data_parallel_shard_size={shard} with zero_stage=0: nothing is sharded; HSDP's shard groups are "
            "ZeRO's (zero_stage 1, 2 or 3)"
        )
    if shard == 1:
        raise ValueError(
            "data_parallel_shard_size=1 shards nothing: every rank would hold whole replicas; use zero_stage=0 (DDP)"
        )
    if shard is None or dp == "auto" or shard == dp:
        return None
    if dp % shard:
        raise ValueError(
            f"data_parallel_shard_size={shard} does not divide data_parallel_size={dp}: ZeRO shards over groups of "
            "that many consecutive data-parallel ranks, and the groups replicate one another"
        )
    return shard


def check_islands(islands: int, data_parallel_size: int, expert_parallel_size: int = 1, cp: int = 1) -> None:
    """DiLoCo's islands are groups of whole data-parallel replicas (asked by the strategy and by `lit3d plan`)."""
    if data_parallel_size % islands:
        raise ValueError(
            f"islands={islands} does not divide data_parallel_size={data_parallel_size}: each island holds the "
            "same number of data-parallel replicas"
        )
    if islands > 1 and (expert_parallel_size > 1 or cp > 1):
        raise ValueError(
            f"islands={islands} with expert_parallel_size={expert_parallel_size} and context_parallel_size={cp} is "
            "not supported: DiLoCo's islands run data, tensor and pipeline parallelism (and ZeRO) inside them"
        )


def check_sizes(**sizes: Any) -> None:
    """Each ``*_size`` is a positive int (``data_parallel_size`` and ``tensor_parallel_size`` may be "auto")."""
    for name, value in sizes.items():
        if name in ("data_parallel_size", "tensor_parallel_size") and value == "auto":
            continue
        if name == "data_parallel_shard_size" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


def check_model_fits_layout(config: Any, layout: Layout) -> None:
    """Refuse a model whose heads, MLP width or vocabulary cannot be split over ``layout.tp`` ranks, or whose
    experts cannot be split over ``layout.ep``."""
    n_expert = getattr(config, "n_expert", 0)
    if layout.ep > 1 and (not n_expert or n_expert % layout.ep):
        raise ValueError(
            f"expert_parallel_size={layout.ep} does not divide n_expert={n_expert}"
            + (" (a dense model has no experts to split)" if not n_expert else "")
        )
    tp = layout.tp
    for field in ("n_head", "n_kv_head", "d_ff", "padded_vocab_size"):
        value = getattr(config, field, None)
        if value is not None and value % tp:
            hint = " (raise pad_vocab_multiple)" if field == "padded_vocab_size" else ""
            raise ValueError(f"tensor_parallel_size={tp} does not divide {field}={value}{hint}")


def check_choices(zero_stage: int, pipeline_schedule: str) -> None:
    """``zero_stage`` and ``pipeline_schedule`` are ones lit3d has (asked by the strategy and by `lit3d plan`)."""
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
    if pipeline_schedule not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={pipeline_schedule!r} is not one of {', '.join(SCHEDULES)}")


def check_pipeline_arguments(pp: int, schedule: str, microbatches: int | None, virtual: int | None) -> None:
    """Schedule, micro-batch and virtual-stage settings that no model could satisfy."""
    if virtual is not None and (not isinstance(virtual, int) or virtual < 1):
        raise ValueError(f"virtual_pipeline_size={virtual!r} must be a positive integer")
    if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
        raise ValueError(f"num_microbatches={microbatches!r} must be a positive integer")
    chunks_per_rank(schedule, virtual)  # the chunks per rank the schedule runs
    if microbatches is not None:
        problem = microbatch_problem(pp, schedule, microbatches)
        if problem:
            raise ValueError(problem)


def default_microbatches(per_replica_batch: int | None, pp: int, virtual: int, schedule: str) -> int:
    """The most micro-batches up to ``2 · pp · virtual`` that divide the per-replica batch (sequences per
    micro-step of one replica) and suit the schedule; ``2 · pp · virtual`` when the batch is not known."""
    if per_replica_batch is None:
        return 2 * pp * virtual
    for m in range(min(2 * pp * virtual, per_replica_batch), 0, -1):
        if per_replica_batch % m == 0 and microbatch_problem(pp, schedule, m) is None:
            return m
    raise ValueError(
        f"a per-replica batch of {per_replica_batch} sequences is too small for "
        f"pipeline_schedule={schedule!r} over pipeline_parallel_size={pp}; raise global_batch_size"
    )


def pipeline_microbatches(
    num_microbatches: int | None,
    global_batch_size: int | None,
    dp: int,
    accumulate: int,
    pp: int,
    virtual: int,
    schedule: str,
) -> int:
    """The micro-batches of one pipeline schedule: ``num_microbatches`` if given, else `default_microbatches` of
    the per-replica batch (``global_batch_size / (dp x accumulate)``, unknown when the batch size is), checked to
    divide that batch."""
    per_replica = None if global_batch_size is None else global_batch_size // (dp * accumulate)
    m = num_microbatches or default_microbatches(per_replica, pp, virtual, schedule)
    if per_replica is not None and per_replica % m:
        raise ValueError(
            f"the per-replica batch of {per_replica} (global_batch_size={global_batch_size} / (data_parallel_size="
            f"{dp} x accumulate_grad_batches={accumulate})) is not divisible by num_microbatches={m}"
        )
    return m


def check_model_fits_pipeline(config: Any, pp: int, virtual: int, schedule: str | None = None) -> None:
    """Every pipeline chunk needs a block of its own, but the first and the last, where the embedding or the head may
    take its place (`lit3d.parallel.stages.end_layers`); and a tied embedding cannot span stages."""
    chunks = pp * virtual
    if chunks > config.n_layer + 2:
        by_default = schedule in DEFAULT_CHUNKS and virtual == DEFAULT_CHUNKS[schedule]
        default = f" ({schedule}'s default)" if by_default else ""
        raise ValueError(
            f"pipeline_parallel_size={pp} x virtual_pipeline_size={virtual}{default} = {chunks} stages, but the model "
            f"has only n_layer={config.n_layer} blocks (and the embedding and the head, which may take a stage each)"
        )
    if pp > 1 and getattr(config, "tie_embeddings", False):
        raise ValueError(
            "tie_embeddings=True with pipeline_parallel_size > 1 is not supported: the embedding and "
            "the head live on different stages; untie them or use pipeline_parallel_size=1"
        )
