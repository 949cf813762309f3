"""What a rank holds, per pipeline stage: weights, gradients and optimizer states (exact, from the model's tensors and
the strategy's rules), the activations kept for backward (Korthikanti et al. 2022, for this architecture) and the
buffers of a moment (`lit3d.planner.buffers`); the peak of a step is the most of its three moments."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from lit3d.models.config import GPTConfig
from lit3d.models.lora_settings import LoRA
from lit3d.parallel.layout import Layout
from lit3d.parallel.schedules import last_stage_in_flight, peak_in_flight
from lit3d.parallel.zero import ZeroPolicy
from lit3d.planner.block_saves import (
    attention_bytes_per_token,
    expert_bias_bytes_per_token,
    gated_tensors,
    norms_per_block,
    repeated_kv_share,
    softcap_bytes_per_token,
)
from lit3d.planner.buffers import peak_memory
from lit3d.planner.shapes import linear_widths
from lit3d.planner.states import RankState, rank_states

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


@dataclass(frozen=True)
class Held:
    """What a layout's pipeline ranks hold whatever the micro-batches in flight, and what a micro-batch keeps for
    backward (`held_by_stage`): the part of `memory_by_stage` that every micro-batch count of a schedule shares."""

    case: Case  # what it was worked out for (of any schedule with these chunks, at any micro-batch count)
    chunks: tuple[int, str]  # per rank, and their placement (`Case.chunks`)
    ranks: tuple[RankState, ...]  # what each holds throughout (ranks alike share one)
    tokens: int  # a rank's, per micro-batch
    per_token: float  # what a block keeps for backward per token (`activation_bytes_per_token`)
    recomputed_block: float  # full recompute: one block rebuilt at a time in backward, for one micro-batch
    loss_moment: float  # what the loss's backward makes beside the activations, on the head's rank
    head_start: float  # LoRA without recompute: what backward's start holds more on the head's rank
    copies: bool  # autocast's bf16 copies of the weights (`_weight_copies`)
    weight_copies: int
    grads_from_start: int  # whole copies of the gradients before backward starts (`peak_memory`)
    element: int  # bytes of an activation
    # A rank's memory by its state, its micro-batches in flight, whether it is rank 0 and the losses it keeps (on the
    # head's rank): worked out once for every schedule and micro-batch count weighed (`rows`)
    seen: dict[tuple, dict[str, int]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def floors(self) -> list[int]:
        """Each rank's least peak, whatever its activations (`RankState.floor`)."""
        return [rank.floor for rank in self.ranks]

    def at(self, schedule: str, microbatches: int) -> Memory:
        """`memory_by_stage` with ``microbatches`` per pipeline schedule of ``schedule`` (one of these chunks)."""
        return self.memory(self.rows(*self.in_flight(schedule, microbatches)))

    def in_flight(self, schedule: str, microbatches: int) -> tuple[tuple[float, ...], float]:
        """The micro-batches whose activations each rank holds at its peak, and the losses the head's rank keeps, with
        ``microbatches`` per pipeline schedule of ``schedule``."""
        pp = len(self.ranks)
        flights = in_flight_by_rank(schedule, pp, microbatches, self.chunks[0])
        return flights, flights[0] if pp == 1 else last_stage_in_flight(schedule, pp, microbatches)

    def rows(self, flights: tuple[float, ...], losses: float) -> list[dict[str, int]]:
        """Each rank's memory with ``flights`` micro-batches in flight (and ``losses`` on the head's rank): rows shared
        by every count that holds as much (`Held.memory` copies them)."""
        rows = []
        for stage_rank, (stage, in_flight) in enumerate(zip(self.ranks, flights)):
            key = (stage, in_flight, stage_rank == 0, losses if stage.holds_head else 0)
            if key not in self.seen:
                self.seen[key] = _stage_memory(self, *key)
            rows.append(self.seen[key])
        return rows

    def memory(self, rows: list[dict[str, int]]) -> Memory:
        """The `Memory` of these ranks with ``rows`` (`rows`)."""
        params_per_rank = max(0, *(stage.params for stage in self.ranks))
        return Memory(
            [dict(row) for row in rows], params_per_rank, int(self.per_token * self.tokens + self.weight_copies)
        )


def held_by_stage(case: Case, chunks: tuple[int, str] | None = None) -> Held:
    """What each pipeline rank of ``case`` holds (rank 0 of its TP and DP groups) whatever its micro-batches in flight:
    its chunks per rank and their placement decide it (``chunks``; default: its schedule's, `Case.chunks`), not their
    number."""
    config, layout, training, settings = case.config, case.layout, case.training, case.settings
    precision, tp, pp = case.precision, layout.tp, layout.pp
    microbatches = training.global_batch_size // (layout.data_replicas * training.micro_batch_size)
    sp, tokens = settings.sequence_parallel and tp > 1, training.micro_batch_size * training.seq_len // layout.cp
    a, checkpointing, zero = precision.activations, settings.activation_checkpointing, case.zero
    lora, software = training.lora, training.software
    fp8_inputs = software.fp8_saved_inputs and settings.float8 is not None
    saves = software.kept_for_backward(settings.compile, bool(config.n_expert))
    repeated = repeated_kv_share(config, case.cluster.gpu.device == "GPU", training.document_length is not None)
    per_token = activation_bytes_per_token(
        config, tp, sp, checkpointing, a, lora, saves, software.recomputed_matmuls, fp8_inputs, repeated
    )
    recomputed_block = 0.0
    if checkpointing in (True, "full"):
        recomputed_block = activation_bytes_per_token(
            config, tp, sp, False, a, lora, saves, fp8_inputs=fp8_inputs, repeated=repeated
        )
        recomputed_block *= tokens
    # the loss's backward (`Software.loss_grad_bytes`) on the stage of the head: every activation alive but the block
    # backward rebuilds later, no parameter's gradient yet
    loss_moment = tokens * config.padded_vocab_size / tp * software.loss_gradient_bytes - recomputed_block
    # frozen weights: backward reaches the final norm with every activation alive, and its backward's fp32
    # temporaries are the step's peak
    head_start = 4 * 4 * config.d_model * tokens / (tp if sp else 1) if lora is not None and not checkpointing else 0
    summed = microbatches > 1  # gradients summed over micro-steps (accumulation) or a pipeline's micro-batches
    # ZeRO-2/3's accumulation without a pipeline: reduce-scattered at every micro-step, summed as shards
    as_shards = summed and pp == 1 and layout.replicas > 1 and zero.reduces_every_micro_step
    # Gradients before backward starts: DDP's buckets, the parameters' sums of earlier micro-steps, or both; the
    # shards of earlier micro-steps.
    ddp = layout.replicas > 1 and zero.all_reduces and not params_cast_by_fsdp(layout, zero, precision)
    grads_from_start = int(ddp) + int(summed and (zero.all_reduces or layout.replicas == 1)) + int(as_shards)
    outer, chunks = settings.outer_momentum if settings.runs_outer_loop else None, chunks or case.chunks
    ranks = rank_states(case.key, layout, chunks, zero, precision, summed and not as_shards, settings.offload, outer)
    copies, weight_copies = _weight_copies(case)
    return Held(
        case, chunks, ranks, tokens, per_token, recomputed_block, loss_moment, head_start, copies, weight_copies,
        grads_from_start, a,
    )  # fmt: skip


def memory_by_stage(case: Case, held: Held | None = None) -> Memory:
    """What each pipeline rank holds (rank 0 of its TP and DP groups) at the peak of a step; ``held``: what it holds
    whatever its micro-batches in flight, `held_by_stage` of ``case`` (or of it at another micro-batch count, or of
    another schedule of its chunks)."""
    layout, training = case.layout, case.training
    microbatches = training.global_batch_size // (layout.data_replicas * training.micro_batch_size)
    schedule_m = microbatches // training.schedules_per_step(layout.pp)  # micro-batches of one pipeline schedule
    return (held or held_by_stage(case)).at(case.settings.pipeline_schedule, schedule_m)


def _stage_memory(held: Held, stage: RankState, in_flight: float, first: bool, losses: float) -> dict[str, int]:
    """The memory of a rank in ``stage`` of ``held`` with ``in_flight`` micro-batches' activations (``first``: rank
    0, that of block 0; ``losses``: the losses the head's rank keeps)."""
    config, layout, training, settings = held.case.config, held.case.layout, held.case.training, held.case.settings
    tp, sp, lora, software = layout.tp, settings.sequence_parallel and layout.tp > 1, training.lora, training.software
    layers, tokens = stage.layers, held.tokens
    kept = _blocks_kept(layers, software.offloaded_layers, held.per_token * tokens, in_flight)
    acts = layers * held.weight_copies + kept
    if first and lora is not None and not settings.activation_checkpointing:  # block 0 keeps less (LoRA)
        acts -= first_block_savings(config, tp, sp, lora, tokens * in_flight, held.copies)
    acts += held.recomputed_block
    if stage.holds_head:
        acts += output_layer_bytes(config, tp, sp, tokens * losses, held.element, lora is not None, software.loss_bytes)
        acts += (
            config.num_nextn_predict_layers
            * tokens
            * losses
            * prediction_depth_bytes_per_token(config, tp, sp, held.element, held.per_token, software.loss_bytes)
        )
        if lora is not None and held.copies:  # the frozen head's bf16 copy, for its input's gradient
            acts += 2 * config.padded_vocab_size * config.d_model / tp
    memory, transient = {**stage.states, "activations": int(acts)}, stage.transient
    if stage.holds_head and held.head_start:
        transient = replace(transient, start=transient.start + held.head_start)
    forward_share = (layers - 1) / layers if layers else 1.0
    loss_grads = held.loss_moment if stage.holds_head else 0
    memory["buffers"], memory["total"] = peak_memory(
        memory, transient, held.grads_from_start, forward_share, loss_grads
    )
    return memory


@lru_cache(maxsize=4096)
def in_flight_by_rank(schedule: str, pp: int, microbatches: int, virtual: int) -> tuple[float, ...]:
    """`peak_in_flight` of each pipeline rank (the search weighs the same schedules for many layouts)."""
    return tuple(peak_in_flight(schedule, pp, microbatches, virtual, rank) for rank in range(pp))


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
    repeated: float = 0.0,
) -> float:
    """Bytes one block keeps for backward, per token: what autograd saves (tests/test_activation_memory.py counts it
    with saved-tensor hooks). ``activations``: bytes per element of the compute dtype (2 in bf16); the norms and the
    log-sum-exp are fp32. With ``lora``: `lora_bytes_per_token`. ``saves``: `Software.kept_for_backward`;
    ``recomputed``: `Software.recomputed_matmuls`; ``fp8_inputs``: `Software.fp8_saved_inputs` (without recompute
    or adapters); ``repeated``: `lit3d.planner.block_saves.repeated_kv_share`."""
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
    norms = norms_per_block(config) * 4 * (2 * h + 1)  # per norm, in fp32: input, input times 1/rms, and 1/rms
    linear_inputs = a * 2 * h  # the norms' outputs in the compute dtype; under SP their shard (`KeepSequenceShard`)
    attention = attention_bytes_per_token(config, a, repeated)  # rotated q, k and v; the output; the log-sum-exp
    latent = 0.0  # latent attention's parts every TP rank computes whole
    if config.kv_lora_rank is not None:
        latent, attention = latent_attention_bytes_per_token(config, a)
    mlp = a * gated_tensors(config) * f  # gate, up, silu(gate), their product
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
        moe = moe_bytes_per_token(config, a)
        return (norms + linear_inputs / 2) / split + a * h + latent + attention / tp + moe
    return (norms + linear_inputs) / split + latent + (attention + mlp) / tp


def latent_attention_bytes_per_token(config: GPTConfig, a: int) -> tuple[float, float]:
    """What multi-head latent attention (`lit3d.models.latent_attention`) keeps per token beyond its input's norm:
    the parts every TP rank computes whole (each latent's RMSNorm in fp32: its input, normalised input and 1/rms; the
    normalised latent, ``q_b_proj``'s and ``kv_b_proj``'s input), and those split by heads (q and k; the values padded
    to their width for the fused kernel; its output and log-sum-exp; ``o_proj``'s input, the output's kept columns).
    In fp32 the key latent's norm keeps its input as a view of ``kv_a_proj_with_mqa``'s whole output, which holds the
    shared rotary key part too."""
    heads, qk, v = config.n_head, config.head_dim, config.v_head_dim
    kv_in = config.kv_lora_rank + (config.qk_rope_head_dim if a == 4 else 0)
    latent = 4 * (kv_in + config.kv_lora_rank + 1) + a * config.kv_lora_rank
    if config.q_lora_rank is not None:
        latent += 4 * (2 * config.q_lora_rank + 1) + a * config.q_lora_rank
    return latent, a * heads * (4 * qk + v) + 4 * heads


def moe_bytes_per_token(config: GPTConfig, a: int) -> float:
    """What the feed-forward of an MoE block (`lit3d.models.moe.MoE`, eager: it is not compiled) keeps for backward
    per token, on every TP rank (a replicated region: every rank routes the same tokens through the same experts;
    under expert parallelism a rank computes the rows it receives, as many on balanced routing): the routed rows and
    the pairs' outputs in token order (``k x d_model`` each), each pair's SwiGLU (``4 x k x d_ff_expert``: gate, up,
    silu(gate) and their product), the router's fp32 scores, top-k indices and weights (fp32, and in the compute
    dtype once renormalised), the two orders of the pairs (int64), and a shared expert's SwiGLU. (Its input, the
    norm's output, is counted with the norms'.) tests/test_activation_memory.py holds it to what autograd saves."""
    h, k, fe = config.d_model, config.n_expert_per_token, config.d_ff_expert
    routed = a * (2 * k * h + gated_tensors(config) * k * fe)
    router = 4 * config.n_expert + (8 + 4 + 8 + 8) * k + 4 + a * k
    return routed + router + 4 * a * config.n_shared_experts * fe + expert_bias_bytes_per_token(config)


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
    linear_inputs = a * h * (bool(targets & {"q", "k", "v", "q_a", "kv_a"}) + bool(targets & {"gate", "up"}))
    attention = a * ((h + 2 * kv) + h) + 4 * config.n_head
    mlp = a * (3 + ("down" in targets)) * f
    adapters = a * lora.rank * len(targets)
    # latent attention's low-rank inputs (whole on every TP rank), kept for the adapters of q_b and kv_b
    latent = {"q_b": config.q_lora_rank or 0, "kv_b": config.kv_lora_rank or 0}
    adapters += a * sum(width for role, width in latent.items() if role in targets)
    if lora.dropout:  # each adapter's dropped input and its mask (one byte)
        inputs = {"q": h, "k": h, "v": h, "o": q / tp, "gate": h, "up": h, "down": f / tp, "q_a": h, "kv_a": h}
        adapters += (a + 1) * sum(inputs.get(t, latent.get(t, 0)) for t in targets)
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
        sizes = linear_widths(config)  # (each adapter's A whole, its B split: as before, for every role)
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
    logits = config.padded_vocab_size / tp * loss_bytes + softcap_bytes_per_token(config, tp, activations)
    return tokens * (norm / (tp if sequence_parallel else 1) + logits)


def prediction_depth_bytes_per_token(
    config: GPTConfig, tp: int, sequence_parallel: bool, activations: int, per_block: float, loss_bytes: int
) -> float:
    """What one multi-token-prediction depth (`lit3d.models.mtp`, on the head's rank) keeps per token: its block's
    (``per_block``, recomputed as the others' are), its three norms' fp32 tensors (on sequence shards under SP), the
    joined normalised pair ``eh_proj`` reads (whole on every TP rank), its final norm's output, the log-probabilities
    of its logits and the ids of the tokens ahead."""
    h, a = config.d_model, activations
    norms, logits = 3 * 4 * (2 * h + 1) + a * h, config.padded_vocab_size / tp * loss_bytes
    return per_block + norms / (tp if sequence_parallel else 1) + a * 2 * h + logits + 8


def params_cast_by_fsdp(layout: Layout, zero: ZeroPolicy, precision: Precision) -> bool:
    """Whether FSDP2 holds the parameters and hands the blocks their compute dtype (its mixed precision policy):
    ZeRO-2/3, and ZeRO-0 unless it is DDP (`lit3d.strategies.optim.dtypes.uses_ddp`: data parallel alone, the gradients
    reduced in the dtype they are held in; bf16-mixed asking for a bf16 reduction is FSDP2's ``replicate``)."""
    if layout.replicas == 1 or zero.slices_optimizer:
        return False
    return zero.shards_parameters or layout.tp > 1 or layout.pp > 1 or precision.reduce_bytes < precision.grads
