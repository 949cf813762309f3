"""Bytes each axis sends per optimizer step, counted from the model's tensors and the strategy's rules."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lit3d.models.config import GPTConfig
from lit3d.models.lora_settings import LoRA
from lit3d.parallel.context import ring_bytes_per_layer
from lit3d.parallel.layout import Layout
from lit3d.parallel.schedules import SCHEDULES
from lit3d.parallel.sharding import BUCKET_ELEMENTS
from lit3d.parallel.zero import ZeroPolicy
from lit3d.planner.muon import orthogonal_traffic
from lit3d.planner.sums import StageSums
from lit3d.planner.tensors import rank_tensors, stepped_numel

if TYPE_CHECKING:
    from lit3d.parallel.settings import Parallelism
    from lit3d.planner.inputs import Case, Precision, Training


def communication_bytes(case: Case, sums: Sequence[StageSums]) -> dict[str, float]:
    """Bytes the busiest GPU of each axis sends per optimizer step, counted as a ring sends them: an all-reduce
    2 (n-1)/n of its tensor, an all-gather or reduce-scatter (n-1)/n of the full tensor, a point-to-point send
    all of it. `lit3d.strategies.telemetry.comm.CommBytes` measures the same way (`lit3d.callbacks.CommReport` puts both
    side by side). Left out: scalars (the logged loss, the gradient norm). ``sums``: the pipeline ranks' `StageSums`
    (`rank_sums`; ranks alike may be given once).
    """
    config, layout, training, settings = case.config, case.layout, case.training, case.settings
    precision = case.precision
    pp, replicas, zero = layout.pp, layout.shard_ranks, case.zero
    virtual, microbatches, schedules, sp, _ = _step_shape(layout, training, settings)
    act_bytes = training.micro_batch_size * training.seq_len // layout.cp * config.d_model * precision.activations
    traffic = {
        "tp": max(tp_bytes_by_stage(case, sums)),
        "pp": 0.0,
        "dp": 0.0,
        "ep": 0.0,
        "cp": 0.0,
    }
    reduces = gradient_reductions(zero, pp, microbatches, schedules)
    shape = (microbatches // schedules, schedules, pp > 1, precision, reduces)
    a2a = _all_to_all_bytes(config, layout, training, settings, precision)
    ring = _ring_bytes(config, layout, training, settings, precision)  # per attention layer and micro-batch
    balance = _balance_bytes(config, layout, training, settings)  # per MoE block and micro-batch
    for stage in sums:
        moe, blocks = stage.moe, stage.blocks
        fp8 = stage.float8 if settings.float8_all_gather else 0  # gathered in FP8: a byte less each than bf16
        sent = _dp_traffic(zero, replicas, stage.in_blocks, stage.root, *shape, stage.trained, fp8)
        if fp8 and replicas > 1:  # their scales, computed after each step from the amaxes: one fp32 all-reduce
            sent += 2 * (replicas - 1) / replicas * stage.float8_tensors * 4
        sent += _dp_traffic(zero, layout.replicas // layout.ep, stage.experts, 0, *shape, stage.trained_experts)
        traffic["dp"] = max(traffic["dp"], sent)
        if zero.hybrid:
            groups = _replicate_traffic(zero, layout, stage.trained, shape[1], pp, precision)
            traffic["dp_replicate"] = max(traffic.get("dp_replicate", 0.0), groups)
        traffic["ep"] = max(traffic["ep"], moe * microbatches * a2a)
        traffic["cp"] = max(traffic["cp"], microbatches * (blocks * ring + moe * balance))
    placement = SCHEDULES[settings.pipeline_schedule].placement
    if pp > 1:
        traffic["pp"] = _pipeline_sends(pp, virtual, placement) * microbatches * act_bytes / (layout.tp if sp else 1)
    if zero.hybrid:  # ZeRO's own traffic stays in each shard group
        traffic["dp_shard"] = traffic.pop("dp")
    for axis, sent in orthogonal_traffic(case, sums).items():
        traffic[axis] += sent
    if layout.islands > 1:  # per step on average: one outer step every sync_every steps
        traffic["island"] = island_bytes_per_sync(config, layout, settings, training.lora) / settings.sync_every
    if (settings.replica_groups or 1) > 1:
        traffic["replica"] = replica_group_bytes(config, layout, settings, training.lora, precision.stepped_bytes)
    return traffic


def tp_bytes_by_stage(case: Case, sums: Sequence[StageSums]) -> list[float]:
    """Bytes each pipeline rank sends to its tensor-parallel group per optimizer step, of its ``sums``."""
    config, layout, training, settings = case.config, case.layout, case.training, case.settings
    precision = case.precision
    tp, pp = layout.tp, layout.pp
    virtual, microbatches, schedules, sp, per_block = _step_shape(layout, training, settings)
    tokens = training.micro_batch_size * training.seq_len // layout.cp  # a rank's tokens per micro-batch
    act_bytes = tokens * config.d_model * precision.activations
    ring = 2 * (tp - 1) / tp  # all-reduce traffic per byte; SP's all-gather + reduce-scatter pair costs the same
    moe_change, sent = _moe_tp_change(settings, sp), []
    for stage in sums:
        tp_blocks = stage.blocks * per_block + stage.moe * moe_change
        tp_bytes = (tp_blocks + stage.first + stage.last) * act_bytes  # embedding (fwd) and head (bwd): one each
        if stage.last:  # the vocabulary-parallel loss: 3 fp32 all-reduces per token (max, sum, target logit)
            tp_bytes += 3 * tokens * 4
        tp_bytes *= microbatches
        if sp:  # SP norms see part of the sequence, so their weights' gradients are all-reduced after each backward
            norms = stage.norms * precision.weights  # NOTE: gradients in the parameters' dtype, not the slices'
            tp_bytes += norms * (schedules if pp > 1 else microbatches)  # once per schedule: it spans its micro-batches
        sent.append(ring * tp_bytes)
    return sent


def island_bytes_per_sync(config: GPTConfig, layout: Layout, settings: Parallelism, lora: LoRA | None = None) -> float:
    """Bytes the busiest rank sends to the other islands at one DiLoCo outer step (all its fragments): the
    all-reduce over the islands of the pseudo-gradient of what its optimizer steps (`stepped_numel`: its ZeRO-1
    slices, ZeRO-2/3 shards or TP shards), in ``settings.outer_reduce_dtype`` (`lit3d.strategies.optim.diloco`)."""
    if layout.islands == 1:
        return 0.0
    element = 2 if settings.outer_reduce_dtype == "bfloat16" else 4
    return 2 * (layout.islands - 1) / layout.islands * _most_stepped(config, layout, settings, lora) * element


def replica_group_bytes(
    config: GPTConfig, layout: Layout, settings: Parallelism, lora: LoRA | None, element: int
) -> float:
    """Bytes the busiest rank sends to the other replica groups each step (``replica_groups``, torchft): the all-reduce
    of the gradients of what its optimizer steps (`stepped_numel`), ``element`` bytes each, over all the groups
    (`lit3d.strategies.runtime.replica_groups`); with DiLoCo across the groups (``sync_every > 1``), per step on
    average, that of the pseudo-gradients (in ``outer_reduce_dtype``) and of the one float that holds a round's start,
    once a round. The quorum's messages are a few hundred bytes, not counted."""
    groups = settings.replica_groups or 1
    if groups == 1:
        return 0.0
    ring, stepped = 2 * (groups - 1) / groups, _most_stepped(config, layout, settings, lora)
    if settings.sync_every > 1:
        outer = 2 if settings.outer_reduce_dtype == "bfloat16" else 4
        return ring * (stepped * outer + 4) / settings.sync_every
    return ring * stepped * element


def _most_stepped(config: GPTConfig, layout: Layout, settings: Parallelism, lora: LoRA | None) -> int:
    """The most elements a rank's optimizer steps, over the pipeline's stages."""
    virtual = settings.chunks_per_rank if layout.pp > 1 else 1
    placement = SCHEDULES[settings.pipeline_schedule].placement
    return max(
        stepped_numel(
            rank_tensors(config, layout.pp, virtual, stage, placement, lora, settings.pipeline_stage_layers),
            layout,
            ZeroPolicy.of(settings, layout),
        )
        for stage in range(layout.pp)
    )


def _ring_bytes(
    config: GPTConfig, layout: Layout, training: Training, settings: Parallelism, precision: Precision
) -> float:
    """Bytes one rank sends around the CP ring per attention layer and micro-batch (`ring_bytes_per_layer`): its
    K and V (its tokens, its TP share of the K/V heads) hop ``cp − 1`` times each way, their gradient ``cp`` times."""
    tokens = training.micro_batch_size * training.seq_len // layout.cp
    kv = 2 * tokens * config.n_kv_head // layout.tp * config.head_dim
    return ring_bytes_per_layer(kv, precision.activations, layout.cp, bool(settings.activation_checkpointing))


def _balance_bytes(config: GPTConfig, layout: Layout, training: Training, settings: Parallelism) -> float:
    """Bytes one rank sends over CP per MoE block and micro-batch: the all-reduce of each sequence's slots and
    scores per expert (fp32) that makes the balance loss whole-sequence (again under full recompute)."""
    if layout.cp == 1:
        return 0.0
    forwards = 2 if settings.activation_checkpointing in (True, "full") else 1
    return forwards * 2 * (layout.cp - 1) / layout.cp * training.micro_batch_size * 2 * config.n_expert * 4


def _moe_tp_change(settings: Parallelism, sp: bool) -> float:
    """TP collectives an MoE block has fewer than a dense one: its feed-forward is a replicated region, which
    under SP gathers its input in forward and its output's gradient in backward (one pair), and nothing else."""
    regather = sp and not settings.activation_checkpointing
    return (1.0 if sp else 0.0) - 2.0 - (0.5 if regather else 0.0)


def _all_to_all_bytes(
    config: GPTConfig, layout: Layout, training: Training, settings: Parallelism, precision: Precision
) -> float:
    """Bytes one rank sends per MoE block and micro-batch over expert parallelism, with an even load: the tokens'
    expert counts, then each (token, choice) row not local to it, to its expert and back, forward and backward
    (and forward again under full recompute)."""
    ep = layout.ep
    if ep == 1:
        return 0.0
    share = (ep - 1) / ep
    rows = training.micro_batch_size * training.seq_len // layout.cp * config.n_expert_per_token * share
    row_bytes = config.d_model * precision.activations
    forwards = 2 if settings.activation_checkpointing in (True, "full") else 1
    return forwards * (config.n_expert * 8 * share + 2 * rows * row_bytes) + 2 * rows * row_bytes


def _replicate_traffic(
    zero: ZeroPolicy, layout: Layout, trained: int, schedules: int, pp: int, precision: Precision
) -> float:
    """HSDP: bytes a GPU sends per step to all-reduce its shard of the ``trained`` elements (MoE experts apart) with
    the other shard groups: once per step (FSDP2 skips it on the micro-steps before the last: `gradient_sync_off`),
    but at the end of each pipeline schedule at ZeRO-2/3 (PyTorch's ``PipelineStage`` syncs there)."""
    groups = zero.groups
    reductions = schedules if pp > 1 and zero.shards_parameters else 1
    return reductions * 2 * (groups - 1) / groups * trained / layout.shard_ranks * precision.reduce_bytes


def gradient_reductions(zero: ZeroPolicy, pp: int, microbatches: int, schedules: int) -> int:
    """How often per optimizer step the gradients are reduced over DP: once per pipeline schedule; without a
    pipeline, once per step, but at every micro-step under ZeRO-2/3 unless ``accumulate_unsharded`` (they accumulate
    as shards)."""
    if pp == 1 and zero.reduces_every_micro_step:
        return microbatches
    return schedules


def _step_shape(layout: Layout, training: Training, settings: Parallelism) -> tuple[int, int, int, bool, float]:
    """(virtual stages per rank, micro-batches per replica and step, pipeline schedules per step, whether SP is
    on, TP collectives per block and micro-batch)."""
    pp, tp = layout.pp, layout.tp
    sp = settings.sequence_parallel and tp > 1
    return (
        settings.chunks_per_rank if pp > 1 else 1,
        training.global_batch_size // (layout.data_replicas * training.micro_batch_size),
        training.schedules_per_step(pp),
        sp,
        _tp_collectives_per_block(settings, sp),
    )


def _pipeline_sends(pp: int, virtual: int, placement: str = "loop") -> int:
    """Sends per micro-batch of the busiest pipeline rank: each chunk sends its output forward and its input's
    gradient backward; the first chunk has no input and the last no output, so the middle ranks send the most,
    and with two ranks each sends 2v-1. In a V the two chunks that meet at the turn share a rank and hand over
    without a send: the end ranks send 2, the middle ones 4."""
    if placement == "v":
        return 2 if pp == 2 else 4
    return 2 * virtual - (pp == 2)


def _tp_collectives_per_block(settings: Parallelism, sp: bool) -> float:
    """All-reduces (or, under SP, all-gather + reduce-scatter pairs) per block and micro-batch.

    2 forward (attention and MLP outputs) and 2 backward (their inputs' gradients). Under SP without recompute each
    region gathers its input again in backward (it kept only the shard, `KeepSequenceShard`): 2 all-gathers, one
    pair's worth. Full recompute reruns the forward up to the last tensor backward needs: the attention all-reduce,
    and under SP also the MLP's all-gather (PyTorch's checkpoint stops early).
    """
    full = settings.activation_checkpointing in (True, "full")
    regather = sp and not settings.activation_checkpointing
    return 4 + (1.5 if sp else 1.0) * full + regather


def collectives(case: Case, sums: Sequence[StageSums]) -> dict[str, tuple[float, float]]:
    """Per axis, the collectives the busiest GPU waits on per optimizer step and their ring hops in all (a ring
    all-reduce over n ranks is 2 (n-1) hops, an all-gather or reduce-scatter n-1, a point-to-point send 1): the
    latency side of an α-β model, counted as `communication_bytes` counts the bytes. ``sums``: the pipeline ranks'
    `StageSums` of the model without its adapters (`rank_sums`; ranks alike may be given once)."""
    layout, training, settings = case.layout, case.training, case.settings
    tp, pp, dp = layout.tp, layout.pp, layout.shard_ranks
    virtual, microbatches, schedules, sp, per_block = _step_shape(layout, training, settings)
    counts = {"tp": (0.0, 0.0), "pp": (0.0, 0.0), "dp": (0.0, 0.0), "ep": (0.0, 0.0), "cp": (0.0, 0.0)}
    cp, zero = layout.cp, case.zero
    placement = SCHEDULES[settings.pipeline_schedule].placement
    for stage in sums:
        first, last, blocks = stage.first, stage.last, stage.blocks
        if cp > 1:  # point-to-point hops per attention layer: forward (again under recompute), then backward
            hops = (cp - 1) * (2 if settings.activation_checkpointing else 1) + (cp - 1) + cp
            counts["cp"] = max(counts["cp"], (blocks * microbatches * hops,) * 2)
        if layout.ep > 1:  # three all-to-alls per MoE block forward (counts, dispatch, combine), two backward
            n = stage.moe * microbatches * 5
            counts["ep"] = max(counts["ep"], (n, n * (layout.ep - 1)))
        if tp > 1:  # an all-reduce, or under SP an all-gather and a reduce-scatter, per count of `per_block`
            n = ((blocks * per_block + first + last) + 3 * last) * microbatches
            counts["tp"] = max(counts["tp"], (n * (2 if sp else 1), n * 2 * (tp - 1)))
        if dp > 1:
            for axis, count in _dp_collectives(zero, stage, schedules if pp > 1 else 1, microbatches, pp).items():
                counts[axis] = max(counts.get(axis, (0.0, 0.0)), count)
    if zero.hybrid:
        counts["dp_shard"] = counts.pop("dp")
    if pp > 1:
        sends = _pipeline_sends(pp, virtual, placement) * microbatches
        counts["pp"] = (sends, sends)
    if layout.islands > 1:  # one all-reduce per fragment per outer step, over a ring of the islands
        n = settings.outer_fragments / settings.sync_every
        counts["island"] = (n, n * 2 * (layout.islands - 1))
    if (settings.replica_groups or 1) > 1:  # one all-reduce a step over a ring of the groups (DiLoCo: two a round)
        n = 1.0 if settings.sync_every == 1 else 2 / settings.sync_every
        counts["replica"] = (n, n * 2 * (settings.replica_groups - 1))
    return counts


def _dp_collectives(
    zero: ZeroPolicy, stage: StageSums, steps: int, microbatches: int, pp: int
) -> dict[str, tuple[float, float]]:
    """(collectives, ring hops) of one pipeline rank's data-parallel sync per step, over its shard group (``dp``),
    and with HSDP's shard groups, their all-reduce across the groups (``dp_replicate``)."""
    units, dp, blocks = stage.blocks + 1, zero.replicas, stage.blocks
    reduces = gradient_reductions(zero, pp, microbatches, steps)
    if zero.all_reduces:
        n, hops = units * steps, 2 * (dp - 1)
    elif zero.slices_optimizer:  # one reduce-scatter and one all-gather per bucket
        n, hops = 2 * -(-stage.total // BUCKET_ELEMENTS), dp - 1
    elif not zero.reshards_after_forward:
        n, hops = units * (steps + reduces), dp - 1
    else:
        gathers = (microbatches // steps + 1, 1) if pp > 1 else (2 * microbatches, microbatches)
        n, hops = (gathers[0] * blocks + gathers[1]) * steps + units * reduces, dp - 1
    counts = {"dp": (n, n * hops)}
    if zero.hybrid:  # an all-reduce per bucket (ZeRO-1), or per unit and pipeline schedule (FSDP2)
        n = n / 2 if zero.slices_optimizer else units * steps
        counts["dp_replicate"] = (n, n * 2 * (zero.groups - 1))
    return counts


def _dp_traffic(
    zero: ZeroPolicy,
    dp: int,
    in_blocks: int,
    root: int,
    microbatches: int,
    schedules: int,
    pipelined: bool,
    precision: Precision,
    reduces: int,
    trained: int | None = None,
    float8: int = 0,
) -> float:
    """Bytes a GPU sends per step to synchronise its parameters (``in_blocks`` + ``root``) over ``dp`` replicas.

    Without a pipeline, DDP's gradients go once per step (not on the micro-steps before it); ZeRO-2/3 reduce-scatter
    them at every micro-step (``reduces`` times: `gradient_reductions`), once with ``accumulate_unsharded``. ZeRO-2
    gathers the weights once per step and keeps them. ZeRO-3 gathers each block for every forward and backward of a
    micro-batch, and the root (embedding, final norm, head; not resharded after forward, since backward starts
    there) once per micro-batch.

    A pipeline schedule (``microbatches`` each, ``schedules`` of them per step under gradient accumulation)
    synchronises gradients at its end, and ZeRO-2 gathers the weights at its start, once per schedule. It keeps
    a chunk gathered after each backward but the last, so under ZeRO-3 only the backwards right after a forward
    gather again: m + 1 gathers of the blocks per schedule, whatever the order, and one of the root. ZeRO-1
    reduce-scatters the gradients and gathers the updated slices once per step, after every schedule.

    ``trained``: the elements that have gradients (LoRA: the adapters; default: all), which ZeRO-1 also gathers.
    ``float8``: the elements of ``in_blocks`` that ZeRO-2/3 gather in FP8 (``float8_all_gather``), one byte each.
    """
    if dp == 1:
        return 0.0
    share = (dp - 1) / dp
    params = in_blocks + root
    trained = params if trained is None else trained
    grads, weights = trained * precision.reduce_bytes, trained * precision.weights
    if zero.slices_optimizer:  # once per step, whatever the schedules: a reduce-scatter and an all-gather of the slices
        return share * (grads + weights)
    fp8_saved = float8 * (precision.gather_bytes - 1)  # per gather of the blocks
    weights = params * precision.gather_bytes - fp8_saved
    if zero.all_reduces:  # all-reduce of the gradients
        return schedules * 2 * share * grads
    if not zero.reshards_after_forward:  # ZeRO-2: reduce-scatter of the gradients, all-gather of the weights
        return share * (reduces * grads + schedules * weights)
    gathers = (microbatches + 1, 1) if pipelined else (2 * microbatches, microbatches)  # blocks, root
    blocks = gathers[0] * (in_blocks * precision.gather_bytes - fp8_saved)
    return share * (reduces * grads + schedules * (blocks + gathers[1] * root * precision.gather_bytes))
