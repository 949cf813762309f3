"""The rank grid: sizes of the three axes, each rank's coordinate, the checks and the rank map.

Ranks are laid out TP-innermost (Megatron's formula)::

    global_rank = t + d * T + p * T * D

so a TP group is a run of T consecutive ranks, which land on one node when T divides the devices per node
(TP is the chattiest axis and wants the fastest link); PP is outermost and crosses nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


class Coordinate(NamedTuple):
    d: int
    t: int
    p: int


@dataclass(frozen=True)
class Layout:
    """``dp × tp × pp`` ranks, ``devices_per_node`` of them on each node."""

    dp: int
    tp: int
    pp: int
    devices_per_node: int

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.devices_per_node)

    def coordinate(self, rank: int) -> Coordinate:
        return Coordinate(d=(rank // self.tp) % self.dp, t=rank % self.tp, p=rank // (self.tp * self.dp))

    def rank(self, d: int, t: int, p: int) -> int:
        return t + d * self.tp + p * self.tp * self.dp

    def node(self, rank: int) -> int:
        return rank // self.devices_per_node

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(d, t, p) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def tp_groups_across_nodes(self) -> list[list[int]]:
        """TP groups whose ranks sit on more than one node (legal, but TP traffic then leaves the fast link)."""
        return [group for group in self.tp_groups() if len({self.node(r) for r in group}) > 1]

    def rank_map(self, max_rows: int = 64) -> str:
        """A table of node, rank and (d, t, p) per rank, with the group sizes; rank 0 prints it at start."""
        lines = [
            f"lit3d layout: {self.world_size} ranks = dp {self.dp} x tp {self.tp} x pp {self.pp}, "
            f"{self.num_nodes} node(s) x {self.devices_per_node} device(s)",
            f"groups: tensor-parallel of {self.tp} (consecutive ranks), data-parallel of {self.dp} "
            f"(stride {self.tp}), pipeline of {self.pp} (stride {self.tp * self.dp})",
        ]
        crossing = self.tp_groups_across_nodes()
        if crossing:
            lines.append(f"WARNING: {len(crossing)} tensor-parallel group(s) span nodes, e.g. ranks {crossing[0]}")
        lines.append("node  rank  (d, t, p)")
        for rank in range(min(self.world_size, max_rows)):
            d, t, p = self.coordinate(rank)
            flag = "  <- TP group spans nodes" if any(rank in g for g in crossing) else ""
            lines.append(f"{self.node(rank):>4}  {rank:>4}  ({d}, {t}, {p}){flag}")
        if self.world_size > max_rows:
            lines.append(f"... {self.world_size - max_rows} more ranks, same pattern")
        return "\n".join(lines)


def resolve_layout(
    world_size: int,
    devices_per_node: int,
    data_parallel_size: int | str,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
) -> Layout:
    """Sizes checked against the world; ``data_parallel_size="auto"`` takes what TP and PP leave."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if world_size % (tp * pp):
        raise ValueError(
            f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} does not divide the {world_size} launched ranks"
        )
    dp = world_size // (tp * pp) if data_parallel_size == "auto" else data_parallel_size
    if dp * tp * pp != world_size:
        raise ValueError(
            f"data_parallel_size={dp} x tensor_parallel_size={tp} x pipeline_parallel_size={pp} = {dp * tp * pp}, "
            f"but {world_size} ranks were launched (devices x num_nodes); make them equal or use "
            "data_parallel_size='auto'"
        )
    return Layout(dp=dp, tp=tp, pp=pp, devices_per_node=devices_per_node)


def check_sizes(**sizes: Any) -> None:
    """Each ``*_size`` is a positive int (``data_parallel_size`` may be "auto")."""
    for name, value in sizes.items():
        if name == "data_parallel_size" and value == "auto":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


def check_model_fits_layout(config: Any, layout: Layout) -> None:
    """Refuse a model whose heads, MLP width or vocabulary cannot be split over ``layout.tp`` ranks."""
    tp = layout.tp
    for field in ("n_head", "n_kv_head", "d_ff", "padded_vocab_size"):
        value = getattr(config, field, None)
        if value is not None and value % tp:
            hint = " (raise pad_vocab_multiple)" if field == "padded_vocab_size" else ""
            raise ValueError(f"tensor_parallel_size={tp} does not divide {field}={value}{hint}")
