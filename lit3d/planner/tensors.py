"""The model's parameter tensors as the planner sees them: shape, the dim TP splits, which pipeline rank holds
each, and how many elements a rank keeps after TP and data-parallel sharding.

Shapes come from the model's config (`lit3d.planner.shapes`, checked against the real model by the tests), each
tensor's split from the model's tensor-parallel plan (`lit3d.models.tp_plan`) and `lit3d.parallel.sharding.SHARDED_DIM`,
its stage from the strategy's own partition (`lit3d.parallel.stages`); no torch (its import alone takes seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from functools import lru_cache
from typing import Any

from lit3d.models.config import GPTConfig
from lit3d.models.lora_settings import LoRA
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
    config, lora = config_of(key), lora_of(key)
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
        table.append(Tensor(name, shape, tp_dim, block, ".experts." in name, trains=lora is None))
        if block is not None and module.split(".", 2)[-1] in targets:
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
    config: GPTConfig, lora: LoRA | None = None, layers: tuple[int, ...] | None = None
) -> tuple[tuple[str, Any], ...]:
    """A hashable stand-in for a (mutable, so unhashable) config, its adapters and its stages' blocks, for the
    caches."""
    fields = tuple(
        (name, tuple(sorted(v.items())) if isinstance(v, dict) else v) for name, v in config.to_dict().items()
    )
    extra = ((("~lora", lora),) if lora is not None else ()) + ((("~layers", tuple(layers)),) if layers else ())
    return fields + extra  # (in the dataclass's field order)


def config_of(key: tuple[tuple[str, Any], ...]) -> GPTConfig:
    fields = {name: dict(v) if name == "rope_scaling" and v else v for name, v in key if not name.startswith("~")}
    return GPTConfig(**fields)


def lora_of(key: tuple[tuple[str, Any], ...]) -> LoRA | None:
    return dict(key).get("~lora")


@lru_cache(maxsize=1024)
def _rank_tensors(
    key: tuple[tuple[str, Any], ...], pp: int, virtual: int, stage_rank: int, placement: str
) -> tuple[Tensor, ...]:
    config = config_of(key)
    chunks = pp * virtual
    stage_ids = chunk_stage_ids(stage_rank, pp, virtual, placement) if pp > 1 else [0]
    runs = stage_blocks(config, chunks, dict(key).get("~layers")) if pp > 1 else (tuple(range(config.n_layer)),)
    blocks = {b for s in stage_ids for b in runs[s]}
    first, last = 0 in stage_ids, chunks - 1 in stage_ids
    kept = []
    for tensor in _parameter_table(key):
        if tensor.block is not None:
            keep = tensor.block in blocks
        else:
            keep = first if tensor.name.startswith("embed") else last
        if keep:
            kept.append(tensor)
    return tuple(kept)


@dataclass(frozen=True, eq=False)
class StageShapes:
    """The parameters of a pipeline rank with its blocks numbered from 0: ranks whose blocks have the same shapes (most
    of a pipeline's) share one, so what is counted from them is counted once (`lit3d.planner.memory`). Compared by
    identity: `stage_shapes` makes one per distinct list."""

    tensors: tuple[Tensor, ...]


# NOTE: the distinct lists `stage_shapes` has seen, so that equal lists are one object (hashed and compared at once);
# emptied when it holds `INTERNED_MOST` (a list made again is then a new object: counted again, never miscounted).
_INTERNED: dict[tuple[Tensor, ...], StageShapes] = {}
INTERNED_MOST = 4096


@lru_cache(maxsize=1024)
def stage_shapes(key: tuple, pp: int, virtual: int, stage_rank: int, placement: str = "loop") -> StageShapes:
    """`key_tensors` of pipeline rank ``stage_rank``, its blocks renumbered in order (`StageShapes`)."""
    tensors = _rank_tensors(key, pp, virtual, stage_rank, placement)
    order = {block: i for i, block in enumerate(dict.fromkeys(t.block for t in tensors if t.block is not None))}

    def renumbered(t: Tensor) -> Tensor:
        if t.block is None:
            return t
        _, block, rest = t.name.split(".", 2)
        return replace(t, name=f"blocks.{order[int(block)]}.{rest}", block=order[t.block])

    shapes = tuple(renumbered(t) for t in tensors)
    if len(_INTERNED) >= INTERNED_MOST:
        _INTERNED.clear()
    return _INTERNED.setdefault(shapes, StageShapes(shapes))


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
    """Elements of ``tensors`` that rank 0's optimizer steps (those that train): ZeRO-1's slices (of a dim TP and EP
    leave whole), ZeRO-2/3's shards, else its whole tensor-parallel shards. DiLoCo's anchor and outer step cover the
    same."""
    tp, ep, dp = layout.tp, layout.ep, layout.replicas
    tensors = [t for t in tensors if t.trains]
    if zero.all_reduces or dp == 1:
        return sum(local_numel(t, tp, ep=ep) for t in tensors)
    if zero.slices_optimizer:
        return sum(local_numel(t, tp, replicas(t, layout), t.free_dim, ep) for t in tensors)
    return sum(local_numel(t, tp, replicas(t, layout), ep=ep) for t in tensors)
