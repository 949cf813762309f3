"""What each pipeline rank holds, summed (`StageSums`): what the traffic (`lit3d.planner.traffic`), the collectives
and the clock (`lit3d.planner.work`) count with, from the model's tensors (`lit3d.planner.tensors`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

from lit3d.parallel.precision import is_float8_linear
from lit3d.parallel.stages import chunk_stage_ids
from lit3d.planner.tensors import StageShapes, Tensor, config_key, local_numel, stage_shapes

if TYPE_CHECKING:
    from lit3d.planner.inputs import Case


def rank_sums(case: Case, adapters: bool = True, chunks: tuple[int, str] | None = None) -> tuple[StageSums, ...]:
    """Each pipeline rank's `StageSums` of ``case``'s model (with its LoRA adapters, or without them), its ``chunks``
    per rank placed as given (default: its schedule's, `Case.chunks`)."""
    layout, settings = case.layout, case.settings
    key = case.key if adapters else config_key(case.config, layers=settings.pipeline_stage_layers)
    return stages(key, layout.pp, *(chunks or case.chunks), layout.tp, layout.ep)


@lru_cache(maxsize=1024)
def stages(key: tuple, pp: int, virtual: int, placement: str, tp: int, ep: int) -> tuple[StageSums, ...]:
    """Each pipeline rank's `StageSums` of the model a `config_key` stands for (cached whole: the search weighs every
    schedule of every layout with them)."""
    return tuple(_stage_sums(key, pp, virtual, placement, stage_rank, tp, ep) for stage_rank in range(pp))


class StageSums(NamedTuple):
    """What one pipeline rank holds, summed: elements of its norms, of the root (embedding, final norm, head), of
    its blocks' dense weights, of its expert weights and of all (each as a TP rank holds it; experts also over EP),
    its MoE blocks and blocks, and whether it holds the first and the last stage; of what trains (all but LoRA's
    frozen weights), the dense elements (``trained``) and the expert ones; the block linears' weights (FP8's)."""

    norms: int
    root: int
    in_blocks: int
    experts: int
    total: int
    moe: int
    blocks: int
    first: bool
    last: bool
    trained: int
    trained_experts: int
    float8: int  # elements of the block linears' weights, which FP8 all-gather gathers in one byte each
    float8_tensors: int
    # Muon's hidden matrices (`Tensor.orthogonal`) but the experts (`orthogonal_experts`), in the optimizer's order
    # (`lit3d.planner.muon` counts their gathers or spread); and the Newton-Schulz iteration's FLOPs over every matrix
    # this rank holds (experts included) were each orthogonalised here
    orthogonal: tuple[Tensor, ...] = ()
    newton_schulz_flops: float = 0.0
    # the experts' matrices as an EP rank holds them, which ZeRO-1 slices over the ranks holding the same experts (the
    # expert mesh's ``edp``) and Muon gathers whole there
    orthogonal_experts: int = 0


def _stage_sums(key: tuple, pp: int, virtual: int, placement: str, stage_rank: int, tp: int, ep: int) -> StageSums:
    stage_ids = chunk_stage_ids(stage_rank, pp, virtual, placement) if pp > 1 else [0]
    sums = _shapes_sums(stage_shapes(key, pp, virtual, stage_rank, placement), tp, ep)
    return sums._replace(first=0 in stage_ids, last=pp * virtual - 1 in stage_ids)


@lru_cache(maxsize=4096)
def _shapes_sums(shapes: StageShapes, tp: int, ep: int) -> StageSums:
    """`StageSums` of a rank holding ``shapes`` (neither the first stage nor the last: `_stage_sums` says)."""

    def numel(keep: Callable[[Tensor], bool], ep: int = 1) -> int:  # of the tensors ``keep`` keeps
        return shapes.sum(lambda group: sum(local_numel(t, tp, ep=ep) for t in group if keep(t)))

    def float8(t: Tensor) -> bool:
        return t.name.endswith(".weight") and is_float8_linear(t.name.rsplit(".", 1)[0])

    return StageSums(
        norms=numel(lambda t: t.trains and "norm" in t.name),  # (their gradients' all-reduce)
        root=numel(lambda t: t.block is None),
        in_blocks=numel(lambda t: t.block is not None and not t.expert),
        experts=numel(lambda t: t.expert, ep),
        total=numel(lambda t: t.trains),  # (ZeRO-1's buckets)
        moe=sum(count for group, count in shapes.groups[1:] if any(t.expert for t in group)),
        blocks=sum(count for _, count in shapes.groups[1:]),
        first=False,
        last=False,
        trained=numel(lambda t: t.trains and not t.expert),
        trained_experts=numel(lambda t: t.trains and t.expert, ep),
        float8=numel(float8),
        float8_tensors=shapes.sum(lambda group: sum(map(float8, group))),
        orthogonal=tuple(t for t in shapes.tensors if t.orthogonal and not t.expert),
        newton_schulz_flops=shapes.sum(lambda group: sum(newton_schulz_flops(t, ep) for t in group if t.orthogonal)),
        orthogonal_experts=numel(lambda t: t.orthogonal and t.expert, ep),
    )


def newton_schulz_flops(tensor: Tensor, ep: int = 1, steps: int = 5) -> float:
    """FLOPs of Muon's ``steps`` quintic Newton-Schulz steps on ``tensor`` (`lit3d.models.muon.newton_schulz`) on the
    rank that holds it: per step ``X Xᵀ``, its square and that times ``X`` for an ``m x n`` matrix (``m <= n``); each
    of a rank's experts (split over ``ep``) its own matrix."""
    rows, cols = sorted(tensor.shape[-2:])
    count = -(-tensor.shape[0] // ep) if tensor.expert else 1
    return count * steps * (2 * rows * rows * cols + 2 * rows**3 + 2 * rows * rows * cols)
