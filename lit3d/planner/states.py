"""What a pipeline rank holds throughout a step, whatever its micro-batches: its weights, gradients and optimizer
states (exact, from the model's tensors and the strategy's rules) and what it holds for a moment
(`lit3d.planner.buffers`). `lit3d.planner.memory` adds the activations."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from lit3d.parallel.layout import Layout
from lit3d.parallel.zero import ZeroPolicy
from lit3d.planner.buffers import Transient, transient_bytes
from lit3d.planner.tensors import StageShapes, local_numel, rank_shapes, replicas, stepped_elements

if TYPE_CHECKING:
    from lit3d.planner.inputs import Precision


def state_bytes(
    shapes: StageShapes, layout: Layout, zero: ZeroPolicy, precision: Precision
) -> tuple[dict[str, int], int, tuple[int, int], int]:
    """Weights, gradients and optimizer state of one rank (rank 0 of its TP and DP groups) holding ``shapes``, the
    elements of its parameters, the elements and tensors its optimizer steps, and the elements of AdamW's larger
    parameter group (the matrices; the norms are the other) among them; frozen weights (LoRA's base) have neither
    gradients nor optimizer state."""
    shard = zero.sharded_over_replicas
    trained = frozen = optimizer = tensors = matrices = orthogonal = 0  # after ZeRO-2/3's sharding; ZeRO-1 slices
    for t, count in shapes.counted:  # the optimizer's
        held = count * local_numel(t, layout.tp, replicas(t, layout) if shard else 1, ep=layout.ep)
        if t.trains:
            stepped = count * stepped_elements(t, layout, zero)
            trained, tensors, optimizer = trained + held, tensors + count, optimizer + stepped
            matrices += stepped if len(t.shape) >= 2 else 0
            orthogonal += stepped if t.orthogonal else 0
        else:
            frozen += held
    # ZeRO-1 keeps the DP average of its optimizer slice only (backward's whole gradients go at the reduce-scatter).
    grads = optimizer if zero.slices_optimizer else trained
    adamw_tensors = tensors - sum(count for t, count in shapes.counted if t.trains and t.orthogonal)
    states = {
        "params": trained * precision.weights + frozen * precision.frozen_bytes,
        "grads": grads * precision.grads,
        # AdamW: its two moments (and master weights where kept) and an fp32 step count per tensor; Muon's matrices
        # (`Tensor.orthogonal`): one fp32 momentum instead of the two moments
        "optimizer": optimizer * precision.optimizer - 4 * orthogonal + 4 * adamw_tensors,
    }
    return states, trained + frozen, (optimizer, tensors), matrices


@dataclass(frozen=True, eq=False)
class RankState:
    """What a pipeline rank holds throughout a step, whatever its micro-batches and recompute: its weights, gradients
    and optimizer states (``host``: offloaded), its blocks, whether it holds the head, what it holds for a moment only,
    its parameters' elements and what its optimizer steps. Compared by identity: ranks of the same shapes share one
    (`rank_states`)."""

    states: dict[str, int]
    layers: int
    holds_head: bool
    transient: Transient
    params: int
    stepped: tuple[int, int]  # elements and tensors its optimizer steps (`lit3d.planner.clock`'s optimizer step)

    @property
    def floor(self) -> int:
        """The least peak, whatever the activations: the states and gradients beside the larger of backward's end and
        the optimizer step (`lit3d.planner.buffers.peak_memory`'s two moments without activations)."""
        states, transient = self.states, self.transient
        return int(states["params"] + states["optimizer"] + states["grads"] + max(transient.end, transient.step))


@lru_cache(maxsize=1024)
def rank_states(
    key: tuple,
    layout: Layout,
    chunks: tuple[int, str],
    zero: ZeroPolicy,
    precision: Precision,
    summed: bool,
    offload: bool,
    outer_momentum: float | None,
) -> tuple[RankState, ...]:
    """The `RankState` of each pipeline rank of the model a `config_key` stands for, its ``chunks`` (per rank, and
    their placement) decide which; ``summed``: gradients summed over micro-steps or a pipeline's micro-batches,
    ``offload``: the states in host memory, ``outer_momentum``: DiLoCo's outer loop's (None: no outer loop)."""
    shapes = rank_shapes(key, layout.pp, *chunks)
    alike = {s: shapes_state(s, layout, zero, precision, summed, offload, outer_momentum) for s in set(shapes)}
    return tuple(alike[s] for s in shapes)


@lru_cache(maxsize=4096)
def shapes_state(
    shapes: StageShapes,
    layout: Layout,
    zero: ZeroPolicy,
    precision: Precision,
    summed: bool,
    offload: bool,
    outer_momentum: float | None = None,
) -> RankState:
    """`RankState` of a rank holding ``shapes``, as `rank_states`.

    NOTE: cached by the rank's shapes (`stage_shapes`), which most ranks of a pipeline share, as the planner weighs
    every schedule for each layout and these sums over the tensors dominate."""
    state, params, stepped, matrices = state_bytes(shapes, layout, zero, precision)
    transient = transient_bytes(shapes, layout, zero, precision, summed, offload, matrices)
    if offload:
        state = {"params": 0, "grads": 0, "optimizer": 0, "host": sum(state.values())}
    if outer_momentum is not None:  # DiLoCo's outer loop, over what the inner optimizer steps: the anchor and the
        # Nesterov momentum held throughout (fp32), and what the outer step makes beside them (each tensor's
        # pseudo-gradient and their concatenation, fp32: `lit3d.strategies.optim.diloco.OuterLoop`)
        state["optimizer"] += 4 * stepped[0] * (1 + (outer_momentum > 0))
        transient = replace(transient, step=max(transient.step, 8 * stepped[0]))
    shard = zero.sharded_over_replicas
    whole = [  # (a rank's experts are its own matrices, each whole where it is: no gather, the rank's part only)
        local_numel(t, layout.tp, replicas(t, layout) if shard else 1, ep=layout.ep) if t.expert else math.prod(t.shape)
        for t, _ in shapes.counted
        if t.trains and t.orthogonal
    ]
    if whole:  # Muon: the largest matrix's update whole (gathered from its shards) in fp32, and the Newton-Schulz
        # iteration's bf16 copy and two products of its size (`lit3d.models.muon`), beside the step's other temporaries
        transient = replace(transient, step=transient.step + (4 + 3 * 2) * max(whole))
    layers = sum(count for group, count in shapes.groups[1:])
    # (the final norm's rank: a tied head is the embedding's tensor, listed once, under "embed")
    head = any(t.name.startswith(("head.", "norm.")) for t in shapes.groups[0][0])
    return RankState(state, layers, head, transient, params, stepped)
