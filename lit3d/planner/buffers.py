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

from dataclasses import dataclass
from typing import Any

from lit3d.parallel.sharding import BUCKET_ELEMENTS
from lit3d.parallel.zero import ZeroPolicy
from lit3d.planner.tensors import Tensor, local_numel, replicas, stepped_numel


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
    tensors: list[Tensor], layout: Any, zero: ZeroPolicy, precision: Any, summed: bool, offload: bool = False
) -> Transient:
    """What a rank holding ``tensors`` keeps for a moment only; ``summed``: gradients are summed over micro-steps or a
    pipeline's micro-batches before they are reduced. ``precision``: `lit3d.planner.estimate.Precision`. With
    ``offload`` (ZeRO-3, even on one replica) the gathers are on the device and AdamW's temporaries on the host."""
    matrices = [t for t in tensors if len(t.shape) >= 2]  # AdamW's larger parameter group (the norms are the other)
    step = 0 if offload else stepped_numel(matrices, layout, zero) * precision.stepped_bytes
    if offload:
        return _fsdp(tensors, layout, zero, precision, summed, step)
    if layout.replicas == 1 or zero.all_reduces:
        return Transient(0, 0, step)
    if zero.slices_optimizer:  # buckets of gradients: of what trains
        return _zero1([t for t in tensors if t.trains], layout, precision, summed, step)
    return _fsdp(tensors, layout, zero, precision, summed, step)


def _zero1(tensors: list[Tensor], layout: Any, precision: Any, summed: bool, step: int) -> Transient:
    rows = sorted(zero1_bucket_rows(tensors, layout), reverse=True) + [0]
    # the rows in the optimizer's dtype, or in the gradients' where a stack holds them narrower (`Software.bf16_grads`)
    kept, wire = min(precision.stepped_bytes, precision.grads), precision.reduce_bytes
    cast = rows[0] * wire if wire != kept else 0  # the largest bucket's rows, cast for the wire
    if summed:  # every bucket's rows from the first micro-step on, and the sums of what ZeRO-1 leaves unsliced
        whole = sum(rows) * kept
        alone = [t for t in tensors if replicas(t, layout) == 1]  # experts with no replica: their own gradients
        aside = sum(local_numel(t, layout.tp, ep=layout.ep) for t in alone) * precision.grads
        return Transient(whole + aside, whole + cast, step)
    # one bucket in flight while the next one fills (`LocalShardOptimizer._launch_next`)
    return Transient(rows[0] * kept, rows[0] * kept + cast + rows[1] * wire, step)


def zero1_bucket_rows(tensors: list[Tensor], layout: Any) -> list[int]:
    """Elements of each ZeRO-1 bucket's rows on rank 0: every DP rank's slice of each tensor (padded to the largest),
    packed in backward's order up to `BUCKET_ELEMENTS` per rank, experts apart (`zero1_buckets.buckets`)."""
    packed: dict[bool, list[list[int]]] = {}
    for t in reversed(tensors):
        ranks = replicas(t, layout)
        part = local_numel(t, layout.tp, ranks, t.free_dim, layout.ep)
        buckets = packed.setdefault(t.expert, [[ranks, 0]])
        if buckets[-1][1] and buckets[-1][1] + part > BUCKET_ELEMENTS:
            buckets.append([ranks, 0])
        buckets[-1][1] += part
    return [ranks * total for buckets in packed.values() for ranks, total in buckets if ranks > 1]


def _fsdp(tensors: list[Tensor], layout: Any, zero: ZeroPolicy, precision: Any, summed: bool, step: int) -> Transient:
    def sizes(group: list[Tensor]) -> tuple[int, int, int]:  # the largest block, the root, everything
        by_block: dict[int | None, int] = {}
        for t in group:
            by_block[t.block] = by_block.get(t.block, 0) + local_numel(t, layout.tp, ep=layout.ep)
        root = by_block.pop(None, 0)
        return max(by_block.values(), default=0), root, root + sum(by_block.values())

    block, root, every = sizes(tensors)  # gathered: every weight, frozen or not
    block_grads, root_grads, every_grad = sizes([t for t in tensors if t.trains])  # what has gradients
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
    moments = [
        (transient.forward, before_backward + memory["activations"] * forward_share + transient.forward),
        (at_loss, before_backward + memory["activations"] + at_loss),
        (transient.start, before_backward + memory["activations"] + transient.start),
        (transient.end, states + grads + transient.end),
        (transient.step, states + grads + transient.step),
    ]
    buffers, total = max(moments, key=lambda moment: moment[1])
    return int(buffers), int(total)
