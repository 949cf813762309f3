"""The model's parameter tensors as the planner sees them: shape, the dim TP splits, which pipeline rank holds
each, and how many elements a rank keeps after TP and data-parallel sharding.

Shapes come from the model's config (`lit3d.planner.shapes`, checked against the real model by the tests), each
tensor's split from the model's tensor-parallel plan (`lit3d.models.tp_plan`) and `lit3d.parallel.sharding.SHARDED_DIM`,
its stage from the strategy's own partition (`lit3d.parallel.stages`); no torch (its import alone takes seconds).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import cached_property, lru_cache
from typing import Any

from lit3d.models.config import GPTConfig
from lit3d.models.lora_settings import LoRA
from lit3d.models.optimizer_settings import is_hidden_matrix
from lit3d.models.tp_plan import tensor_parallel_plan
from lit3d.parallel.sharding import SHARDED_DIM
from lit3d.parallel.stages import chunk_stage_ids, stage_runs
from lit3d.parallel.zero import ZeroPolicy
from lit3d.planner.shapes import block_costs, parameter_shapes


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # the dim tensor parallelism splits, None when replicated
    block: int | None  # decoder block index; None for embedding, final norm, head
    expert: bool = False  # an MoE expert weight: dim 0 is split over expert parallelism, dim 1 by ZeRO-1
    trains: bool = True  # False: frozen (LoRA's base weights), no gradient and no optimizer state
    orthogonal: bool = False  # Muon steps it (`lit3d.models.optimizer_settings.is_hidden_matrix`): one momentum

    @property
    def free_dim(self) -> int:
        """The dim ZeRO-1 slices over data parallelism: one TP and EP leave whole, else (a column-parallel linear's
        bias) the dim TP splits, each rank's part sliced again."""
        return 1 if self.expert else next((d for d in range(len(self.shape)) if d != self.tp_dim), 0)


def parameter_table(config: GPTConfig, lora: LoRA | None = None) -> tuple[Tensor, ...]:
    """Every parameter tensor of the model: name, shape, the dim TP splits, its block; with ``lora``, the adapters
    too, and every other tensor frozen."""
    return _parameter_table(config_key(config, lora))


@lru_cache(maxsize=16)
def _parameter_table(key: tuple[tuple[str, Any], ...]) -> tuple[Tensor, ...]:
    config, lora, muon = config_of(key), lora_of(key), dict(key).get("~optimizer") == "muon"
    plan, table = tensor_parallel_plan(config), []
    targets, shapes, listed = lora.module_names() if lora else (), parameter_shapes(config), set()
    for index, (name, shape) in enumerate(shapes):
        if name in listed:
            continue
        module = name.rsplit(".", 1)[0]
        roles = [role for pattern, role in plan.items() if fnmatchcase(module, pattern)]
        block = int(name.split(".")[1]) if name.startswith("blocks.") else None
        tp_dim = SHARDED_DIM.get(roles[0]) if roles else None
        if name.endswith(".bias"):  # split with the outputs of a column-parallel linear
            tp_dim = 0 if tp_dim == 0 else None
        orthogonal = muon and is_hidden_matrix(name, len(shape))
        table.append(
            Tensor(name, shape, tp_dim, block, ".experts." in name, trains=lora is None, orthogonal=orthogonal)
        )
        # a linear's name inside its block: a decoder block's, or multi-token prediction's (``mtp.0.block.``)
        inner = module.split(".", 2)[-1] if block is not None else module.partition(".block.")[2]
        if inner in targets and (block is not None or name.startswith("mtp.")):
            bias = shapes[index + 1] if shapes[index + 1][0] == f"{module}.bias" else None
            if bias is not None:  # the adapters come after it, as `LoRALinear` registers them
                table.append(Tensor(bias[0], bias[1], 0 if tp_dim == 0 else None, block, trains=False))
                listed.add(bias[0])
            table += adapter_tensors(module, shape, tp_dim, block, lora.rank)
        elif ".experts." in name and name.rsplit(".", 1)[-1].removesuffix("_proj") in (lora.targets if lora else ()):
            experts, inner, outer = shape  # each expert's adapter, stacked as its weights (`lit3d.models.moe.Experts`)
            table += [
                Tensor(f"{name}_lora_a", (experts, inner, lora.rank), None, block, expert=True),
                Tensor(f"{name}_lora_b", (experts, lora.rank, outer), None, block, expert=True),
            ]
    return tuple(table)


def adapter_params(config: GPTConfig, lora: LoRA) -> int:
    """Elements of the LoRA adapters one token uses: every adapter, an MoE layer's experts' as k of them."""
    active = config.n_expert_per_token / config.n_expert if config.n_expert else 1.0
    return round(
        sum(math.prod(t.shape) * (active if t.expert else 1) for t in parameter_table(config, lora) if t.trains)
    )


def adapter_tensors(module: str, shape: tuple[int, ...], tp_dim: int | None, block: int, rank: int) -> list[Tensor]:
    """LoRA's ``A`` ``(rank, in)`` and ``B`` ``(out, rank)`` beside a linear's weight ``(out, in)``: a column-parallel
    linear splits ``B`` along its output, a row-parallel one ``A`` along its input (`lit3d.models.lora`)."""
    out, inner = shape
    return [
        Tensor(f"{module}.lora_a", (rank, inner), 1 if tp_dim == 1 else None, block),
        Tensor(f"{module}.lora_b", (out, rank), 0 if tp_dim == 0 else None, block),
    ]


def stage_blocks(config: GPTConfig, chunks: int, layers: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], ...]:
    """Blocks of each pipeline chunk, as the strategy splits them (``layers``: `pipeline_stage_layers`)."""
    return _stage_blocks(config_key(config, layers=layers), chunks)


@lru_cache(maxsize=64)
def _stage_blocks(key: tuple[tuple[str, Any], ...], chunks: int) -> tuple[tuple[int, ...], ...]:
    runs = stage_runs(*block_costs(config_of(key)), chunks, dict(key).get("~layers"))
    return tuple(tuple(run) for run in runs)


def rank_tensors(
    config: GPTConfig,
    pp: int,
    virtual: int,
    stage_rank: int,
    placement: str = "loop",
    lora: LoRA | None = None,
    layers: tuple[int, ...] | None = None,
) -> list[Tensor]:
    """The parameters pipeline rank ``stage_rank`` holds (its chunks' blocks, embedding/head on the ends), its chunks
    placed as the schedule places them (`chunk_stage_ids`); with ``lora``, its adapters too; ``layers``: the blocks
    of each stage (`pipeline_stage_layers`), else cut by cost."""
    return key_tensors(config_key(config, lora, layers), pp, virtual, stage_rank, placement)


def key_tensors(key: tuple, pp: int, virtual: int, stage_rank: int, placement: str = "loop") -> list[Tensor]:
    """`rank_tensors` of the model a `config_key` stands for."""
    return list(_rank_tensors(key, pp, virtual, stage_rank, placement))


def config_key(
    config: GPTConfig, lora: LoRA | None = None, layers: tuple[int, ...] | None = None, optimizer: str = "adamw"
) -> tuple[tuple[str, Any], ...]:
    """A hashable stand-in for a (mutable, so unhashable) config, its adapters, its stages' blocks and its optimizer
    (``"muon"``: its hidden matrices `Tensor.orthogonal`), for the caches."""
    fields = tuple(
        (name, tuple(sorted(v.items())) if isinstance(v, dict) else tuple(v) if isinstance(v, list) else v)
        for name, v in config.to_dict().items()
    )
    extra = ((("~lora", lora),) if lora is not None else ()) + ((("~layers", tuple(layers)),) if layers else ())
    extra += (("~optimizer", optimizer),) if optimizer != "adamw" else ()
    return fields + extra  # (in the dataclass's field order)


def config_of(key: tuple[tuple[str, Any], ...]) -> GPTConfig:
    fields = {name: dict(v) if name == "rope_scaling" and v else v for name, v in key if not name.startswith("~")}
    if fields.get("layer_types") is not None:
        fields["layer_types"] = list(fields["layer_types"])
    return GPTConfig(**fields)


def lora_of(key: tuple[tuple[str, Any], ...]) -> LoRA | None:
    return dict(key).get("~lora")


@lru_cache(maxsize=1024)
def _rank_tensors(
    key: tuple[tuple[str, Any], ...], pp: int, virtual: int, stage_rank: int, placement: str
) -> tuple[Tensor, ...]:
    first, last, blocks = _rank_blocks(key, pp, virtual, stage_rank, placement)
    kept = []
    for block, tensors in _table_runs(key):
        if block is None:
            kept += [t for t in tensors if (first if t.name.startswith("embed") else last)]
        elif block in blocks:
            kept += tensors
    return tuple(kept)


def _rank_blocks(
    key: tuple[tuple[str, Any], ...], pp: int, virtual: int, stage_rank: int, placement: str
) -> tuple[bool, bool, set[int]]:
    """Whether pipeline rank ``stage_rank`` holds the first stage and the last, and the blocks of its stages."""
    chunks = pp * virtual
    stage_ids = chunk_stage_ids(stage_rank, pp, virtual, placement) if pp > 1 else [0]
    runs = _stage_blocks(key, chunks) if pp > 1 else (tuple(range(dict(key)["n_layer"])),)
    return 0 in stage_ids, chunks - 1 in stage_ids, {b for s in stage_ids for b in runs[s]}


@lru_cache(maxsize=16)
def _table_runs(key: tuple[tuple[str, Any], ...]) -> tuple[tuple[int | None, tuple[Tensor, ...]], ...]:
    """`parameter_table` in runs of tensors of the same block (None: the embedding, final norm, head), in order."""
    runs: list[tuple[int | None, list[Tensor]]] = []
    for tensor in _parameter_table(key):
        if not runs or runs[-1][0] != tensor.block:
            runs.append((tensor.block, []))
        runs[-1][1].append(tensor)
    return tuple((block, tuple(tensors)) for block, tensors in runs)


@dataclass(frozen=True, eq=False)
class StageShapes:
    """The parameters of a pipeline rank with its blocks numbered from 0: ranks whose blocks have the same shapes (most
    of a pipeline's) share one, so what is counted from them is counted once (`lit3d.planner.memory`). Compared by
    identity: `stage_shapes` makes one per distinct list."""

    tensors: tuple[Tensor, ...]

    @cached_property
    def groups(self) -> tuple[tuple[tuple[Tensor, ...], int], ...]:
        """The tensors as groups that repeat, each with how many times: the root's (embedding, final norm, head; block
        None) once, then the first block of each kind (the same names past ``blocks.N.``, shapes and splits) with the
        number of blocks of that kind. A sum over the tensors is the sum over each group's, times its count."""
        blocks: dict[int | None, list[Tensor]] = {}
        for t in self.tensors:
            blocks.setdefault(t.block, []).append(t)
        root, kinds = tuple(blocks.pop(None, ())), {}
        for tensors in blocks.values():
            kind = tuple((t.name.split(".", 2)[2], t.shape, t.tp_dim, t.expert, t.trains) for t in tensors)
            kinds.setdefault(kind, [tuple(tensors), 0])[1] += 1
        return ((root, 1), *((tensors, count) for tensors, count in kinds.values()))

    @cached_property
    def kinds(self) -> tuple[tuple[Tensor, ...], tuple[int, ...]]:
        """The distinct tensors (as `groups` tells them apart: a block's by their names past ``blocks.N.``, shapes and
        splits) and, for each tensor in order, the index of its own among them."""
        index: dict[tuple, int] = {}
        distinct, order = [], []
        for t in self.tensors:
            name = t.name if t.block is None else t.name.split(".", 2)[2]
            kind = index.setdefault((t.block is None, name, t.shape, t.tp_dim, t.expert, t.trains), len(distinct))
            if kind == len(distinct):
                distinct.append(t)
            order.append(kind)
        return tuple(distinct), tuple(order)

    @cached_property
    def counted(self) -> tuple[tuple[Tensor, int], ...]:
        """Each distinct tensor (`kinds`) with how many of its kind the rank holds."""
        kinds, order = self.kinds
        counts = [0] * len(kinds)
        for kind in order:
            counts[kind] += 1
        return tuple(zip(kinds, counts, strict=True))

    def sum(self, count: Callable[[list[Tensor]], int]) -> int:
        """``count(tensors)`` of all the tensors, for a ``count`` that sums a number per tensor: over `groups`."""
        return sum(count(list(tensors)) * times for tensors, times in self.groups)


@lru_cache(maxsize=1024)
def rank_shapes(key: tuple, pp: int, virtual: int, placement: str = "loop") -> tuple[StageShapes, ...]:
    """`stage_shapes` of each pipeline rank (ranks alike share one)."""
    return tuple(stage_shapes(key, pp, virtual, stage_rank, placement) for stage_rank in range(pp))


@lru_cache(maxsize=1024)
def stage_shapes(key: tuple, pp: int, virtual: int, stage_rank: int, placement: str = "loop") -> StageShapes:
    """`key_tensors` of pipeline rank ``stage_rank``, its blocks renumbered in order (`StageShapes`)."""
    first, last, blocks = _rank_blocks(key, pp, virtual, stage_rank, placement)
    kinds = _block_kinds(key)
    return _shapes(key, first, last, tuple(kinds[b] for b in sorted(blocks)))


@lru_cache(maxsize=16)
def _block_kinds(key: tuple[tuple[str, Any], ...]) -> dict[int, int]:
    """Each block's kind: the first block whose tensors have the same names past ``blocks.N.``, shapes and splits."""
    signatures = {
        block: tuple((t.name.split(".", 2)[2], t.shape, t.tp_dim, t.expert, t.trains) for t in tensors)
        for block, tensors in _table_blocks(key).items()
    }
    first: dict[tuple, int] = {}
    for block, signature in signatures.items():
        first.setdefault(signature, block)
    return {block: first[signature] for block, signature in signatures.items()}


@lru_cache(maxsize=16)
def _table_blocks(key: tuple[tuple[str, Any], ...]) -> dict[int, tuple[Tensor, ...]]:
    """`parameter_table`'s tensors of each block."""
    blocks: dict[int, list[Tensor]] = {}
    for block, tensors in _table_runs(key):
        if block is not None:
            blocks.setdefault(block, []).extend(tensors)
    return {block: tuple(tensors) for block, tensors in blocks.items()}


@lru_cache(maxsize=1024)
def _shapes(key: tuple[tuple[str, Any], ...], first: bool, last: bool, kinds: tuple[int, ...]) -> StageShapes:
    """The `StageShapes` of a rank that holds the first stage and the last or not, and blocks of ``kinds`` in order
    (`_block_kinds`): one object for every rank alike. NOTE: the table lists the blocks' tensors together, the
    embedding before them, the final norm and the head after them (`lit3d.planner.shapes.parameter_shapes`)."""
    blocks, tensors, placed = _table_blocks(key), [], False
    for block, run in _table_runs(key):
        if block is None:
            tensors += [t for t in run if (first if t.name.startswith("embed") else last)]
        elif not placed:  # the rank's blocks, each as the first block of its kind, numbered from 0
            tensors += [_renumbered(t, i) for i, kind in enumerate(kinds) for t in blocks[kind]]
            placed = True
    return StageShapes(tuple(tensors))


def _renumbered(t: Tensor, block: int) -> Tensor:
    """``t`` as the tensor of block ``block``."""
    return Tensor(f"blocks.{block}.{t.name.split('.', 2)[2]}", t.shape, t.tp_dim, block, t.expert, t.trains,
                  t.orthogonal)  # fmt: skip


def local_numel(tensor: Tensor, tp: int, shard: int = 1, shard_dim: int = 0, ep: int = 1) -> int:
    """Elements rank 0 of ``shard`` data-parallel ranks holds (torch.chunk's split, as DTensor's Shard); an expert
    weight is first split over ``ep`` expert-parallel ranks."""
    shape = list(tensor.shape)
    if tensor.tp_dim is not None:
        shape[tensor.tp_dim] //= tp
    if tensor.expert:
        shape[0] = -(-shape[0] // ep)
    if shard != 1:  # NOTE: the search calls this half a million times; most calls shard nothing
        shape[shard_dim] = -(-shape[shard_dim] // shard)
    return math.prod(shape)


def replicas(tensor: Tensor, layout: Any) -> int:
    """Ranks that hold the same copy of ``tensor`` and shard it under ZeRO: the ``dp × cp`` replicas (HSDP: those of
    a shard group), or for an expert the DP ranks over expert-parallel groups."""
    return layout.replicas // layout.ep if tensor.expert else layout.shard_ranks


def stepped_numel(tensors: list[Tensor], layout: Any, zero: ZeroPolicy) -> int:
    """Elements of ``tensors`` that rank 0's optimizer steps (those that train: `stepped_elements`). DiLoCo's anchor
    and outer step cover the same."""
    return sum(stepped_elements(t, layout, zero) for t in tensors if t.trains)


def stepped_elements(tensor: Tensor, layout: Any, zero: ZeroPolicy) -> int:
    """Elements of ``tensor`` (one that trains) that rank 0's optimizer steps: ZeRO-1's slice (of a dim TP and EP leave
    whole), ZeRO-2/3's shard, else its whole tensor-parallel shard."""
    if zero.all_reduces or layout.replicas == 1:
        return local_numel(tensor, layout.tp, ep=layout.ep)
    if zero.slices_optimizer:
        return local_numel(tensor, layout.tp, replicas(tensor, layout), tensor.free_dim, layout.ep)
    return local_numel(tensor, layout.tp, replicas(tensor, layout), ep=layout.ep)
