"""What a rank holds, per pipeline stage: weights, gradients and optimizer states (exact, from the model's tensors and
the strategy's rules), the activations kept for backward (Korthikanti et al. 2022, for this architecture) and the
buffers of a moment (`lit3d.planner.buffers`); the peak of a step is the most of its three moments."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from lit3d.models.config import GPTConfig
from lit3d.models.lora_settings import LoRA
from lit3d.parallel.layout import Layout
from lit3d.parallel.schedules import SCHEDULES, last_stage_in_flight, peak_in_flight
from lit3d.parallel.zero import ZeroPolicy
from lit3d.planner.buffers import Transient, peak_memory, transient_bytes
from lit3d.planner.tensors import (
    StageShapes,
    Tensor,
    local_numel,
    replicas,
    stage_shapes,
    stepped_numel,
)

if TYPE_CHECKING:
    from lit3d.planner.inputs import Case, Precision


@dataclass(frozen=True)
class Memory:
    """Bytes by kind on each pipeline rank (``total``: its peak), and the numbers the plan reports beside them."""

    by_stage: list[dict[str, int]]
    params_per_rank: int  # parameters (elements) the most loaded rank holds, ZeRO-3 shards included
    activation_bytes_per_layer: int  # what one block keeps for backward, per micro-batch on one rank

    @property
    def peak(self) -> dict[str, int]:
        """The most loaded rank's."""
        return max(self.by_stage, key=lambda m: m["total"])


def memory_by_stage(case: Case) -> Memory:
    """What each pipeline rank holds (rank 0 of its TP and DP groups) at the peak of a step."""
    config, layout, training, settings = case.config, case.layout, case.training, case.settings
    precision, tp, pp = case.precision, layout.tp, layout.pp
    virtual = settings.chunks_per_rank if pp > 1 else 1
    microbatches = training.global_batch_size // (layout.data_replicas * training.micro_batch_size)
    schedule_m = microbatches // training.schedules_per_step(pp)  # micro-batches of one pipeline schedule
    sp, schedule = settings.sequence_parallel and tp > 1, settings.pipeline_schedule
    tokens = training.micro_batch_size * training.seq_len // layout.cp  # a rank's, per micro-batch
    a, checkpointing, zero = precision.activations, settings.activation_checkpointing, case.zero
    lora, software = training.lora, training.software
    saves, recomputed = software.saved_activations, software.recomputed_matmuls
    fp8_inputs = software.fp8_saved_inputs and settings.float8 is not None
    per_token = activation_bytes_per_token(config, tp, sp, checkpointing, a, lora, saves, recomputed, fp8_inputs)
    recomputed_block = 0.0  # full recompute: one block rebuilt at a time in backward, for one micro-batch
    if checkpointing in (True, "full"):
        recomputed_block = activation_bytes_per_token(config, tp, sp, False, a, lora, saves, fp8_inputs=fp8_inputs)
        recomputed_block *= tokens
    # the loss's backward (`Software.loss_grad_bytes`) on the stage of the head: every activation alive but the block
    # backward rebuilds later, no parameter's gradient yet
    loss_moment = tokens * config.padded_vocab_size / tp * software.loss_gradient_bytes - recomputed_block
    copies, weight_copies = _weight_copies(case)
    summed = microbatches > 1  # gradients summed over micro-steps (accumulation) or a pipeline's micro-batches
    # ZeRO-2/3's accumulation without a pipeline: reduce-scattered at every micro-step, summed as shards
    as_shards = summed and pp == 1 and layout.replicas > 1 and zero.reduces_every_micro_step
    offload = settings.offload  # ZeRO-3's shards, gradients and optimizer states in host memory
    # Gradients before backward starts: DDP's buckets, the parameters' sums of earlier micro-steps, or both; the
    # shards of earlier micro-steps.
    ddp = layout.replicas > 1 and zero.all_reduces and not params_cast_by_fsdp(layout, zero, precision)
    grads_from_start = int(ddp) + int(summed and (zero.all_reduces or layout.replicas == 1)) + int(as_shards)
    placement = SCHEDULES[schedule].placement  # which chunks each pipeline rank holds
    by_stage, params_per_rank, key = [], 0, case.key
    for stage_rank in range(pp):
        unsharded_sums = summed and not as_shards
        held = _stage_state(key, layout, virtual, stage_rank, placement, zero, precision, unsharded_sums, offload)
        memory, layers, holds_head, transient, params = dict(held[0]), *held[1:]
        params_per_rank = max(params_per_rank, params)
        if settings.runs_outer_loop:
            outer, sync = _outer_loop(case, stage_rank, virtual, placement)
            memory["optimizer"] += outer
            transient = replace(transient, step=max(transient.step, sync))
        in_flight = peak_in_flight(schedule, pp, schedule_m, virtual, stage_rank)
        acts = layers * weight_copies + _blocks_kept(layers, software.offloaded_layers, per_token * tokens, in_flight)
        if stage_rank == 0 and lora is not None and not checkpointing:  # (the stage of block 0)
            acts -= first_block_savings(config, tp, sp, lora, tokens * in_flight, copies)
        acts += recomputed_block
        if holds_head:
            losses = in_flight if pp == 1 else last_stage_in_flight(schedule, pp, schedule_m)
            acts += output_layer_bytes(config, tp, sp, tokens * losses, a, lora is not None, software.loss_bytes)
            if lora is not None and copies:  # the frozen head's bf16 copy, for its input's gradient
                acts += 2 * config.padded_vocab_size * config.d_model / tp
        memory["activations"] = int(acts)
        if holds_head and lora is not None and not checkpointing:  # frozen weights: backward reaches the final
            # norm with every activation alive, and its backward's fp32 temporaries are the step's peak
            transient = replace(transient, start=transient.start + 4 * 4 * config.d_model * tokens / (tp if sp else 1))
        forward_share = (layers - 1) / layers if layers else 1.0
        loss_grads = loss_moment if holds_head else 0
        memory["buffers"], memory["total"] = peak_memory(memory, transient, grads_from_start, forward_share, loss_grads)
        by_stage.append(memory)
    return Memory(by_stage, params_per_rank, int(per_token * tokens + weight_copies))


def _outer_loop(case: Case, stage_rank: int, virtual: int, placement: str) -> tuple[int, int]:
    """DiLoCo's outer loop on a pipeline rank (`lit3d.strategies.optim.diloco.OuterLoop`), over what its inner optimizer
    steps: the anchor and the Nesterov momentum it holds throughout (fp32), and what its outer step makes beside them
    (each tensor's pseudo-gradient and their concatenation, fp32)."""
    layout, settings = case.layout, case.settings
    shapes = stage_shapes(case.key, layout.pp, virtual, stage_rank, placement)
    stepped = stepped_numel(list(shapes.tensors), layout, case.zero)
    return 4 * stepped * (1 + (settings.outer_momentum > 0)), 8 * stepped


def _weight_copies(case: Case) -> tuple[bool, int]:
    """Mixed precision with fp32 parameters in forward: whether autocast copies a block's weights to bf16 (under LoRA
    the frozen weights may be fp32 where the adapters are not: ZeRO-1's master weights), and the bytes of one block's
    copies, saved for backward, one per block per step."""
    config, layout, precision, lora = case.config, case.layout, case.precision, case.training.lora
    cast = not case.settings.activation_checkpointing and not params_cast_by_fsdp(layout, case.zero, precision)
    copies = cast and (precision.frozen_bytes if lora else precision.weights) > precision.activations
    adapter_copies = cast and lora is not None and precision.weights > precision.activations
    return copies, autocast_weight_bytes(config, layout.tp, lora, copies, adapter_copies)


def _blocks_kept(layers: int, offloaded: int, per_block: float, in_flight: int) -> float:
    """What a pipeline rank's ``layers`` blocks keep for backward, ``per_block`` each per micro-batch, ``in_flight``
    micro-batches: the ``offloaded`` blocks' (`Software.offloaded_layers`) in host memory but one block's in transit."""
    gone = min(offloaded, layers)
    return (layers - gone) * per_block * in_flight + (per_block if gone else 0)


def state_bytes(tensors: list[Tensor], layout: Layout, zero: ZeroPolicy, precision: Precision) -> dict[str, int]:
    """Weights, gradients and optimizer state of one rank (rank 0 of its TP and DP groups); frozen weights (LoRA's
    base) have neither gradients nor optimizer state."""
    tp, ep = layout.tp, layout.ep

    def held(group: list[Tensor]) -> int:  # after ZeRO-2/3's sharding
        if zero.sharded_over_replicas:
            return sum(local_numel(t, tp, replicas(t, layout), ep=ep) for t in group)
        return sum(local_numel(t, tp, ep=ep) for t in group)

    trained = [t for t in tensors if t.trains]
    optimizer = stepped_numel(tensors, layout, zero)  # ZeRO-1 slices a dim TP (and EP) leave whole
    step_counters = 4 * len(trained)  # AdamW keeps one fp32 step count per tensor
    # ZeRO-1 keeps the DP average of its optimizer slice only (backward's whole gradients go at the reduce-scatter).
    grads = optimizer if zero.slices_optimizer else held(trained)
    frozen = [t for t in tensors if not t.trains]
    return {
        "params": held(trained) * precision.weights + held(frozen) * precision.frozen_bytes,
        "grads": grads * precision.grads,
        "optimizer": optimizer * precision.optimizer + step_counters,
    }


def activation_bytes_per_token(
    config: GPTConfig,
    tp: int,
    sequence_parallel: bool,
    checkpointing: bool | str,
    activations: int = 4,
    lora: LoRA | None = None,
    saves: str = "eager",
    recomputed: float | None = None,
    fp8_inputs: bool = False,
) -> float:
    """Bytes one block keeps for backward, per token: what autograd saves (tests/test_activation_memory.py counts
    it with saved-tensor hooks). ``activations``: bytes per element of the compute dtype (2 in bf16). The norms
    compute in fp32 and attention's log-sum-exp is fp32 in any precision. With ``lora``: `lora_bytes_per_token`.
    ``saves``: ``fused`` or ``compiled`` norm and SwiGLU kernels (`lit3d.planner.inputs.Software.saved_activations`);
    ``recomputed``: under selective recompute, the share of matmuls a per-op policy runs again
    (`Software.recomputed_matmuls`); ``fp8_inputs``: FP8 linears that keep their inputs' FP8 casts
    (`Software.fp8_saved_inputs`), counted without recompute or adapters."""
    h, f, kv, a = config.d_model, config.d_ff, config.n_kv_head * config.head_dim, activations
    if lora is not None and not checkpointing:
        return lora_bytes_per_token(config, tp, sequence_parallel, activations, lora)
    split = tp if sequence_parallel else 1
    lse = 4 * config.n_head / tp
    # what `lit3d.strategies.split.recompute` keeps under "selective": matmul, attention, collective outputs
    if checkpointing == "selective":
        sharded = 2 * h + 2 * kv + 2 * f  # q, k, v, the attention output, gate and up
        rowwise = 2 * h  # o_proj and down_proj outputs, before their reduction
        reduced = 2 * h / split if tp > 1 else 0  # the all-reduce (SP: reduce-scatter) outputs
        gathered = 2 * h if sequence_parallel else 0  # SP: the all-gathered inputs of both regions
        if recomputed is not None:  # a per-op policy (torchtitan's): the matmul outputs it keeps, the attention
            # output, the reductions' outputs; the gathers run again
            kept = (1 - recomputed) * ((sharded - h) / tp + rowwise) + h / tp
            return a * (h / split + kept + reduced) + lse
        return a * (h / split + sharded / tp + rowwise + reduced + gathered) + lse
    if checkpointing:
        return a * h / split  # only the block's input; the rest is recomputed
    norms = 4 * 2 * (2 * h + 1)  # per norm, in fp32: its input, the input times 1/rms, and 1/rms
    linear_inputs = a * 2 * h  # the norms' outputs in the compute dtype; under SP their shard (`KeepSequenceShard`)
    attention = a * ((h + 2 * kv) + h) + 4 * config.n_head  # rotated q, k and v; the output; the log-sum-exp
    mlp = a * 4 * f  # gate, up, silu(gate), their product
    if saves in ("fused", "compiled"):  # each norm keeps its input in the compute dtype and 1/rms, the SwiGLU its
        # input (gate and up); fused kernels keep both outputs too, a compiler recomputes them
        norms, mlp = 2 * (a * h + 4), a * 2 * f
        if saves == "fused":
            mlp += a * f
        else:
            linear_inputs = 0
    if fp8_inputs:  # one byte per element for the norms' outputs and the SwiGLU's (also where a compiler would not
        # keep them); the attention output's cast beside the output attention keeps anyway
        linear_inputs, attention = 2 * h, attention + h
        mlp += f if saves == "compiled" else (1 - a) * f
    if config.n_expert and saves != "fused" and not fp8_inputs:  # lit3d's MoE blocks, eager under compile too (their
        # first dense ones counted as MoE ones): a replicated region under TP, on the whole sequence under SP too; the
        # attention's norm output as a dense block's (`moe_bytes_per_token`). (Another stack's fused kernels: as dense)
        return (norms + linear_inputs / 2) / split + a * h + attention / tp + moe_bytes_per_token(config, a)
    return (norms + linear_inputs) / split + (attention + mlp) / tp


def moe_bytes_per_token(config: GPTConfig, a: int) -> float:
    """What the feed-forward of an MoE block (`lit3d.models.moe.MoE`, eager: it is not compiled) keeps for backward
    per token, on every TP rank (a replicated region: every rank routes the same tokens through the same experts;
    under expert parallelism a rank computes the rows it receives, as many on balanced routing): the routed rows and
    the pairs' outputs in token order (``k x d_model`` each), each pair's SwiGLU (``4 x k x d_ff_expert``: gate, up,
    silu(gate) and their product), the router's fp32 scores, top-k indices and weights (fp32, and in the compute
    dtype once renormalised), the two orders of the pairs (int64), and a shared expert's SwiGLU. (Its input, the
    norm's output, is counted with the norms'.) tests/test_activation_memory.py holds it to what autograd saves."""
    h, k, fe = config.d_model, config.n_expert_per_token, config.d_ff_expert
    routed = a * (2 * k * h + 4 * k * fe)
    router = 4 * config.n_expert + (8 + 4 + 8 + 8) * k + 4 + a * k
    return routed + router + 4 * a * config.n_shared_expert * fe


def lora_bytes_per_token(config: GPTConfig, tp: int, sequence_parallel: bool, a: int, lora: LoRA) -> float:
    """`activation_bytes_per_token` of a block whose weights are frozen, with adapters on ``lora.targets``.

    A frozen linear keeps no input (only its weight's gradient needs it), nor does a frozen norm its normalised
    input; an adapter keeps its linear's input (the attention's output is kept anyway), its dropout's output and
    mask if any, and ``A``'s output (``rank`` per token, whole on every TP rank). Attention and SwiGLU keep what they
    keep in any case; the down projection's input only for its adapter. (The first block keeps less:
    `first_block_savings`.)"""
    h, f, kv, targets = config.d_model, config.d_ff, config.n_kv_head * config.head_dim, set(lora.targets)
    q = config.n_head * config.head_dim
    split = tp if sequence_parallel else 1
    norms = 2 * 4 * (h + 1)  # per norm, in fp32: its input and 1/rms
    linear_inputs = a * h * (bool(targets & {"q", "k", "v"}) + bool(targets & {"gate", "up"}))
    attention = a * ((h + 2 * kv) + h) + 4 * config.n_head
    mlp = a * (3 + ("down" in targets)) * f
    adapters = a * lora.rank * len(targets)
    if lora.dropout:  # each adapter's dropped input and its mask (one byte)
        inputs = {"q": h, "k": h, "v": h, "o": q / tp, "gate": h, "up": h, "down": f / tp}
        adapters += (a + 1) * sum(inputs[t] for t in targets)
    return (norms + linear_inputs) / split + (attention + mlp) / tp + adapters


def first_block_savings(
    config: GPTConfig, tp: int, sequence_parallel: bool, lora: LoRA, tokens: int, copies: bool
) -> float:
    """What the first block keeps less than `lora_bytes_per_token` counts for ``tokens``: its input needs no gradient
    (the embedding is frozen), so its first norm keeps nothing, nor does autocast keep q, k and v's weight copies,
    which only the input's gradient would need. (With no adapter on q, k or v, the block keeps less again; not
    counted.)"""
    if not set(lora.targets) & {"q", "k", "v"}:
        return 0.0
    h, kv, q = config.d_model, config.n_kv_head * config.head_dim, config.n_head * config.head_dim
    norm = 4 * (h + 1) / (tp if sequence_parallel else 1) * tokens
    return norm + (2 * h * (q + 2 * kv) / tp if copies else 0.0)


def autocast_weight_bytes(
    config: GPTConfig, tp: int, lora: LoRA | None = None, weights: bool = True, adapters: bool = False
) -> int:
    """What autocast keeps per block where the parameters are fp32 in forward (bf16-mixed without FSDP2's cast:
    DDP, no data parallelism): the bf16 copy of every weight it cast, saved for backward; ``weights``: of the
    block's weights, ``adapters``: of ``lora``'s adapters."""
    h, f, kv = config.d_model, config.d_ff, config.n_kv_head * config.head_dim
    held = (2 * h * h + 2 * h * kv + 3 * h * f) // tp if weights else 0
    if adapters and lora is not None:
        sizes = {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h), "gate": (h, f), "up": (h, f), "down": (f, h)}
        held += sum(lora.rank * (inner + outer / tp) for inner, outer in (sizes[t] for t in lora.targets))
    return int(2 * held)


def output_layer_bytes(
    config: GPTConfig,
    tp: int,
    sequence_parallel: bool,
    tokens: int,
    activations: int,
    frozen: bool = False,
    loss_bytes: int = 4,
) -> float:
    """What the final norm and the loss keep for backward: the norm's fp32 tensors as in a block and its output in
    the compute dtype (the head's input), and the log-probabilities of the (vocabulary-split) logits, in fp32 unless
    ``loss_bytes`` says otherwise (`Software.loss_bytes`). A ``frozen`` norm and head (LoRA) keep neither the
    normalised input nor the head's input."""
    h = config.d_model
    norm = 4 * (h + 1) if frozen else 4 * (2 * h + 1) + activations * h
    return tokens * (norm / (tp if sequence_parallel else 1) + config.padded_vocab_size / tp * loss_bytes)


def params_cast_by_fsdp(layout: Layout, zero: ZeroPolicy, precision: Precision) -> bool:
    """Whether FSDP2 holds the parameters and hands the blocks their compute dtype (its mixed precision policy):
    ZeRO-2/3, and ZeRO-0 unless it is DDP (`lit3d.strategies.optim.dtypes.uses_ddp`: data parallel alone, the gradients
    reduced in the dtype they are held in; bf16-mixed asking for a bf16 reduction is FSDP2's ``replicate``)."""
    if layout.replicas == 1 or zero.slices_optimizer:
        return False
    return zero.shards_parameters or layout.tp > 1 or layout.pp > 1 or precision.reduce_bytes < precision.grads


@lru_cache(maxsize=4096)
def _stage_state(
    key: tuple,
    layout: Layout,
    virtual: int,
    stage_rank: int,
    placement: str,
    zero: ZeroPolicy,
    precision: Precision,
    summed: bool,
    offload: bool = False,
) -> tuple[tuple[tuple[str, int], ...], int, bool, Transient, int]:
    """What pipeline rank ``stage_rank`` holds whatever the schedule's micro-batches: its weights, gradients and
    optimizer state, its number of blocks, whether it holds the head, what it holds for a moment only
    (`lit3d.planner.buffers`; ``summed``: gradients summed over micro-steps or a pipeline's micro-batches), and its
    parameters' elements. With ``offload`` the states are in host memory (``host``) and the device holds none.

    NOTE: cached twice, as the planner weighs every schedule for each layout and these sums over the tensors dominate:
    by rank here, and by the rank's shapes (`stage_shapes`), which most ranks of a pipeline share."""
    shapes = stage_shapes(key, layout.pp, virtual, stage_rank, placement)
    return _shapes_state(shapes, layout, zero, precision, summed, offload)


@lru_cache(maxsize=4096)
def _shapes_state(
    shapes: StageShapes, layout: Layout, zero: ZeroPolicy, precision: Precision, summed: bool, offload: bool
) -> tuple[tuple[tuple[str, int], ...], int, bool, Transient, int]:
    """`_stage_state` of a rank holding ``shapes``."""
    tensors = list(shapes.tensors)
    state = state_bytes(tensors, layout, zero, precision)
    params = sum(
        local_numel(t, layout.tp, replicas(t, layout) if zero.sharded_over_replicas else 1, ep=layout.ep)
        for t in tensors
    )
    transient = transient_bytes(tensors, layout, zero, precision, summed, offload)
    if offload:
        state = {"params": 0, "grads": 0, "optimizer": 0, "host": sum(state.values())}
    layers = len({t.block for t in tensors if t.block is not None})
    head = any(t.name.startswith("head") for t in tensors)
    return tuple(state.items()), layers, head, transient, params
