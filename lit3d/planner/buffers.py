"""What a rank holds for part of a training step only, beyond its weights, gradients, optimizer states and
activations, and when: the peak of a step is the most of these moments (`peak_memory`).

- the loss's backward: every activation, beside the gradients already whole and the parameters gathered, with what
  the loss makes (`lit3d.planner.inputs.Software.loss_grad_bytes`) before any parameter has a gradient;
- backward's start: every activation, beside the gradients already whole (DDP's buckets; the sums of earlier
  micro-steps where the parameters hold them) and the buffers of the first blocks backward reaches;
- backward's end: every gradient, beside the buffers of the last blocks;
- the optimizer step: every gradient, beside AdamW's temporaries (PyTorch's default on GPUs, ``foreach``, makes
  one tensor the size of the parameters it steps; ``fused`` makes none).

The buffers by ZeRO stage, as lit3d runs them (measured with `lit3d.strategies.telemetry.live_memory` on CPU ranks):

- ZeRO-1 (`lit3d.strategies.optim.zero1_buckets.Bucket`): each bucket's gradient rows in the optimizer's dtype, the only
  whole gradient; one bucket filling and one in flight, or every bucket while micro-steps or a pipeline's
  micro-batches sum into them; cast to the reduce dtype on the wire if it differs.
- ZeRO-2/3 (FSDP2): parameters gathered in the gather dtype (ZeRO-3: the block computing, the next one's gather and
  the root; ZeRO-2: every block from its forward to its backward), a block's reduce-scatter input in the reduce dtype
  and the root's unsharded gradients, held until its reduce-scatter at backward's end. Without a gradient sync on
  micro-steps or a pipeline's micro-batches, every unsharded gradient summed in the reduce dtype, and under a
  pipeline every parameter kept gathered until the schedule's end (PyTorch's `PipelineStage`).
- ZeRO-0: none beyond what it holds throughout (DDP's buckets are its gradients; summing micro-steps, the
  parameters' own sums too: Lightning drops the gradients each step, so DDP's no-sync micro-steps sum into new ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from lit3d.parallel.sharding import BUCKET_ELEMENTS
from lit3d.parallel.zero import ZeroPolicy
from lit3d.planner.tensors import StageShapes, local_numel, replicas


@dataclass(frozen=True)
class Transient:
    """Bytes held for a moment of the step only: at backward's start, at its end, in the optimizer step, and (ZeRO-3)
    in forward, when a block's gather is copied out beside the next block's, already under way."""

    start: int
    end: int
    step: int
    forward: int = 0
    gathered: int = 0  # (ZeRO-2/3) the parameters gathered when backward begins, before any gradient


def transient_bytes(
    shapes: StageShapes, layout: Any, zero: ZeroPolicy, precision: Any, summed: bool, offload: bool, matrices: int
) -> Transient:
    """What a rank holding ``shapes`` keeps for a moment only; ``summed``: gradients are summed over micro-steps or a
    pipeline's micro-batches before they are reduced. ``precision``: `lit3d.planner.estimate.Precision`. With
    ``offload`` (ZeRO-3, even on one replica) the gathers are on the device and AdamW's temporaries on the host.
    ``matrices``: the elements of AdamW's larger parameter group its optimizer steps (`lit3d.planner.states`)."""
    step = 0 if offload else matrices * precision.stepped_bytes
    sharded = layout.replicas > 1 and not zero.all_reduces
    if offload or sharded and not zero.slices_optimizer:
        transient, grads = _fsdp(shapes, layout, zero, precision, summed, step), precision.gather_bytes
    elif sharded:  # buckets of gradients: of what trains
        transient, grads = _zero1(shapes, layout, precision, summed, step), precision.grads
    else:
        transient, grads = Transient(0, 0, step), precision.grads
    return replace(transient, end=transient.end + whole_embedding_grad(shapes, layout) * grads)


def whole_embedding_grad(shapes: StageShapes, layout: Any) -> int:
    """Elements of the vocabulary-parallel embedding's gradient as backward's end returns it under TP: the whole table
    on every TP rank, beside the rows the rank keeps of it (`lit3d.strategies.split.tensor_parallel.
    lay_out_grads_like_params`, ZeRO-1's buckets and FSDP2 take them from it); 0 without TP or the embedding.
    Measured: without it, a 2-block model at DP2 x TP2 x PP2 peaked at 1.31x its plan, the embedding's stage."""
    if layout.tp == 1:
        return 0
    embedding = (t for t in shapes.tensors if t.block is None and t.name.startswith("embed"))
    return sum(math.prod(t.shape) for t in embedding if t.tp_dim is not None and t.trains)


def _zero1(shapes: StageShapes, layout: Any, precision: Any, summed: bool, step: int) -> Transient:
    rows = sorted(zero1_bucket_rows(shapes, layout), reverse=True) + [0]
    # the rows in the optimizer's dtype, or in the gradients' where a stack holds them narrower (`Software.bf16_grads`)
    kept, wire = min(precision.stepped_bytes, precision.grads), precision.reduce_bytes
    cast = rows[0] * wire if wire != kept else 0  # the largest bucket's rows, cast for the wire
    if summed:  # every bucket's rows from the first micro-step on, and the sums of what ZeRO-1 leaves unsliced
        whole = sum(rows) * kept

        alone = [(t, n) for t, n in shapes.counted if t.trains and replicas(t, layout) == 1]  # experts with no replica
        aside = (
            sum(n * local_numel(t, layout.tp, ep=layout.ep) for t, n in alone) * precision.grads
        )  # (their own grads)
        return Transient(whole + aside, whole + cast, step)
    # one bucket in flight while the next one fills (`LocalShardOptimizer._launch_next`)
    return Transient(rows[0] * kept, rows[0] * kept + cast + rows[1] * wire, step)


def zero1_bucket_rows(shapes: StageShapes, layout: Any) -> list[int]:
    """Elements of each ZeRO-1 bucket's rows on rank 0: every DP rank's slice of each tensor that trains (padded to
    the largest), packed in backward's order up to `BUCKET_ELEMENTS` per rank, experts apart
    (`zero1_buckets.buckets`)."""
    kinds, order = shapes.kinds  # (each distinct tensor's slice worked out once)
    parts = []
    for t in kinds:
        ranks = replicas(t, layout)
        parts.append((ranks, local_numel(t, layout.tp, ranks, t.free_dim, layout.ep)))
    rows = []
    for expert in (False, True):
        kept = [parts[k] for k in reversed(order) if kinds[k].trains and kinds[k].expert == expert]
        bucket, total = kept[0][0] if kept else 1, 0  # (a bucket: the ranks of its first tensor, its elements)
        for ranks, part in kept:
            if total and total + part > BUCKET_ELEMENTS:
                rows.append((bucket, total))
                bucket, total = ranks, 0
            total += part
        rows += [(bucket, total)] if kept else []
    return [ranks * total for ranks, total in rows if ranks > 1]


def _fsdp(shapes: StageShapes, layout: Any, zero: ZeroPolicy, precision: Any, summed: bool, step: int) -> Transient:
    def sizes(trained: bool) -> tuple[int, int, int]:  # the largest block, the root, everything (of what trains)
        (root, _), *blocks = [
            (sum(local_numel(t, layout.tp, ep=layout.ep) for t in tensors if t.trains or not trained), count)
            for tensors, count in shapes.groups
        ]
        return max((numel for numel, _ in blocks), default=0), root, root + sum(n * count for n, count in blocks)

    block, root, every = sizes(False)  # gathered: every weight, frozen or not
    block_grads, root_grads, every_grad = sizes(True)  # what has gradients
    gather, reduce = precision.gather_bytes, precision.reduce_bytes
    scatter = block_grads * reduce  # a block's reduce-scatter input
    if summed and layout.pp > 1:  # every parameter kept gathered beside a block's gather, every gradient unsharded,
        # to the schedule's end; there each block is resharded before its reduce-scatter (no more than that)
        return Transient(every * gather + every_grad * reduce + block * gather, scatter, step)
    # The root stays gathered for the whole step, and its unsharded gradients wait for its reduce-scatter at
    # backward's end; ZeRO-3 holds the block backward computes and the next one's gather, ZeRO-2 every block.
    gathered = (root + 2 * block if zero.reshards_after_forward else every) * gather
    end = (root + root_grads + block) * gather + scatter
    # ZeRO-3's forward: a block's all-gather output and the parameters it is copied out to, beside the next block's
    # output (prefetched), and the root.
    forward = (root + 3 * block) * gather if zero.reshards_after_forward else 0
    if summed:  # every unsharded gradient summed in the reduce dtype, beside the first block's new ones
        return Transient(gathered + every_grad * reduce + block_grads * gather, end, step, forward, gathered)
    return Transient(gathered + root_grads * gather + scatter, end, step, forward, gathered)


def peak_memory(
    memory: dict[str, int],
    transient: Transient,
    grads_from_start: int,
    forward_share: float = 1.0,
    loss_grads: float = 0,
) -> tuple[int, int]:
    """``(buffers, total)`` at the step's peak, the most of forward's last gather, the loss's backward, backward's
    start, its end and the optimizer step. ``grads_from_start``: how many whole copies of the gradients exist before
    backward starts (DDP's buckets, sums of micro-steps that the parameters hold); ``forward_share``: the share of
    the activations kept by the time forward gathers its last block; ``loss_grads``: what the loss's backward makes
    beside every activation (`lit3d.planner.inputs.Software.loss_grad_bytes`), before any parameter's gradient."""
    states = memory["params"] + memory["optimizer"]
    grads = memory["grads"]
    before_backward = states + grads * grads_from_start
    at_loss = transient.gathered + loss_grads
    activations = memory["activations"]
    moments = (
        (transient.forward, before_backward + activations * forward_share + transient.forward),
        (at_loss, before_backward + activations + at_loss),
        (transient.start, before_backward + activations + transient.start),
        (transient.end, states + grads + transient.end),
        (transient.step, states + grads + transient.step),
    )
    buffers, total = moments[0]
    for moment in moments[1:]:  # (the first of the largest)
        if moment[1] > total:
            buffers, total = moment
    return int(buffers), int(total)
