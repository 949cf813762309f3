"""Memory, communication, bubble and step time of one layout: arithmetic only, no GPU.

Parameter shapes come from the real model built on the meta device, and each tensor's split from the model's
tensor-parallel plan, the strategy's pipeline partition and its ZeRO rules, so the per-rank counts are exact
(`lit3d plan --verify` checks them against the real parallelised model). Activations follow the per-layer
accounting of Korthikanti et al. (2022) for this architecture (RMSNorm, SwiGLU, grouped-query attention,
fused attention that stores no score matrix). Step time is a simple roofline: matmul time at an assumed
efficiency, tensor-parallel and pipeline traffic exposed, data-parallel traffic hidden behind backward
where it fits, the whole stretched by the pipeline bubble.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any

from lit3d.config import GPTConfig
from lit3d.parallel.layout import Layout
from lit3d.parallel.precision import is_bf16_mixed, keeps_master_weights
from lit3d.parallel.schedules import SCHEDULES, Costs, bubble_theory, last_stage_in_flight, peak_in_flight
from lit3d.planner.buffers import Transient, peak_memory, transient_bytes
from lit3d.planner.tensors import Tensor, config_key, local_numel, rank_tensors, replicas, stepped_numel
from lit3d.planner.traffic import collectives, communication_bytes

GB = 1e9


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter held as weights, gradients and optimizer state, and per stored activation; and per
    element on the wire: ``gathered`` for FSDP's parameter gathers, ``reduced`` for gradient reductions (default:
    as held); ``stepped``: of the tensors the optimizer steps (default: the weights; fp32 master weights)."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    gathered: int | None = None
    reduced: int | None = None
    stepped: int | None = None

    @property
    def gather_bytes(self) -> int:
        return self.weights if self.gathered is None else self.gathered

    @property
    def reduce_bytes(self) -> int:
        return self.grads if self.reduced is None else self.reduced

    @property
    def stepped_bytes(self) -> int:
        return self.weights if self.stepped is None else self.stepped


# Bytes per element a lit3d run holds and sends, by Lightning's precision: the one table both the search and the run's
# own estimate (`lit3d.planner.run.plan_of_run`) read, through `held_precision`.
PRECISIONS = {
    "32-true": Precision(4, 4, 8, 4),  # fp32 everything; AdamW's two moments
    "bf16-true": Precision(2, 2, 4, 2),
    # fp32 parameters computed in bf16 (`lit3d.strategies.precision`): FSDP2's shards gathered in bf16, DDP's replicas
    # cast by autocast (its bf16 copies are activations: `autocast_weight_bytes`); gradients reduced in fp32.
    "bf16-mixed": Precision(4, 4, 8, 2, gathered=2, reduced=4),
    "16-mixed": Precision(4, 4, 8, 2),
}
# ZeRO-1 under bf16-mixed (`keeps_master_weights`): bf16 parameters; in the optimizer's slices the fp32 master weights,
# both moments and the fp32 gradient; the updated slices all-gathered in bf16. Megatron's distributed optimizer:
# 2 + (4 + 12) / D bytes per parameter.
MASTER_WEIGHTS = Precision(2, 4, 12, 2, gathered=2, reduced=4, stepped=4)


@dataclass
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    intra_node_gbps: float = 450.0  # NVLink, GB/s per direction
    inter_node_gbps: float = 50.0  # InfiniBand share of one GPU, GB/s
    peak_tflops: float = 989.0  # dense bf16
    # The α of the α-β model, from NCCL's own tuning model (src/graph/tuning.cc, ring algorithm, Simple protocol):
    # a base latency per collective and a hardware latency per ring hop, over NVLink and over the network.
    collective_latency_us: float = 8.4
    intra_node_hop_us: float = 5.7
    inter_node_hop_us: float = 6.6
    # The link between DiLoCo's islands (datacenters), per GPU as the links above: about a hundredth of InfiniBand's
    # bandwidth, and milliseconds of latency per hop.
    inter_island_gbps: float = 1.0
    inter_island_latency_ms: float = 10.0
    device: str = "GPU"  # what the reports call one rank's device ("CPU process" for a rehearsal on CPU)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Training:
    seq_len: int = 2048
    micro_batch_size: int = 1
    global_batch_size: int = 512  # sequences per optimizer step
    # Micro-steps per optimizer step that each run a whole pipeline schedule (pp > 1): the schedule then has
    # global_batch_size / (dp x micro_batch_size x accumulate_grad_batches) micro-batches. Without a pipeline
    # every micro-batch is a micro-step of its own already.
    accumulate_grad_batches: int = 1
    precision: str = "bf16-mixed"
    mixed_precision_reduce: str = "float32"  # under bf16-mixed, what gradients are reduced in ("bfloat16": half)
    zero_stage: int = 1
    sequence_parallel: bool = True
    activation_checkpointing: bool | str = False  # True or "full", "selective"
    pipeline_schedule: str = "1f1b"
    virtual_pipeline_size: int = 1
    sync_every: int = 1  # DiLoCo's inner steps per outer step (with islands)
    outer_reduce_dtype: str = "float32"  # what the pseudo-gradients travel between islands in
    outer_fragments: int = 1  # streaming DiLoCo: fragments synced at staggered steps
    efficiency: float = 0.6  # share of the peak that matmuls reach
    headroom: float = 0.1  # of GPU memory kept free for the allocator, CUDA context and buffers

    def schedules_per_step(self, pp: int) -> int:
        """Pipeline schedules run per optimizer step (gradient accumulation repeats the whole schedule)."""
        return self.accumulate_grad_batches if pp > 1 else 1


@dataclass
class Plan:
    layout: dict[str, int]
    # Bytes on the most loaded rank: what it holds of each kind at most, and its peak (``total``: the most of backward's
    # start, its end and the optimizer step, not their sum, `buffers.peak_memory`), with the buffers of that moment.
    memory_per_gpu: dict[str, int]
    communication_per_step: dict[str, dict[str, float]]  # per axis: bytes (per GPU) and seconds
    pipeline_bubble: float
    step_time_s: float
    mfu: float
    fits: bool
    num_microbatches: int
    memory_by_stage: list[dict[str, int]] = field(default_factory=list)
    flops_per_step: float = 0.0  # model FLOPs of one optimizer step, all GPUs (recompute not counted)
    params_total: int = 0
    params_per_rank: int = 0  # parameters (elements) the most loaded rank holds, ZeRO-3 shards included
    params_active: int = 0  # parameters one token uses (MoE: k of the routed experts; a dense model: all)
    activation_bytes_per_layer: int = 0  # what one block keeps for backward, per micro-batch on one rank
    pipeline_schedule: str | None = None  # with a pipeline: the schedule this estimate runs
    # With a pipeline: every schedule the planner weighed for this layout (`lit3d.planner.pipeline`), each with its
    # micro-batches, bubble, step time and activations.
    schedule_candidates: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def held_precision(training: Training, layout: Layout) -> Precision:
    """Bytes per element that a lit3d run of ``training`` on ``layout`` holds and sends: ``training.precision``'s row
    of `PRECISIONS`, or `MASTER_WEIGHTS` where the strategy keeps master weights, with the reduce dtype asked for."""
    precision = PRECISIONS[training.precision]
    if keeps_master_weights(training.precision, training.zero_stage, layout.replicas):
        precision = MASTER_WEIGHTS
    if is_bf16_mixed(training.precision) and training.mixed_precision_reduce == "bfloat16":
        precision = replace(precision, reduced=2)
    return precision


def state_bytes(tensors: list[Tensor], layout: Layout, zero_stage: int, precision: Precision) -> dict[str, int]:
    """Weights, gradients and optimizer state of one rank (rank 0 of its TP and DP groups)."""
    tp, dp, ep = layout.tp, layout.replicas, layout.ep
    full = sum(local_numel(t, tp, ep=ep) for t in tensors)
    sharded = sum(local_numel(t, tp, replicas(t, layout), ep=ep) for t in tensors)
    sharded_params = sharded if zero_stage >= 2 and dp > 1 else full
    optimizer = stepped_numel(tensors, layout, zero_stage)  # ZeRO-1 slices a dim TP (and EP) leave whole
    step_counters = 4 * len(tensors)  # AdamW keeps one fp32 step count per tensor
    # ZeRO-1 keeps the DP average of its optimizer slice only (backward's whole gradients go at the reduce-scatter).
    grads = optimizer if zero_stage == 1 and dp > 1 else sharded_params
    return {
        "params": sharded_params * precision.weights,
        "grads": grads * precision.grads,
        "optimizer": optimizer * precision.optimizer + step_counters,
    }


def activation_bytes_per_token(
    config: GPTConfig, tp: int, sequence_parallel: bool, checkpointing: bool | str, activations: int = 4
) -> float:
    """Bytes one block keeps for backward, per token: what autograd saves (tests/test_activation_memory.py counts
    it with saved-tensor hooks). ``activations``: bytes per element of the compute dtype (2 in bf16). The norms
    compute in fp32 and attention's log-sum-exp is fp32 in any precision."""
    h, f, kv, a = config.d_model, config.d_ff, config.n_kv_head * config.head_dim, activations
    split = tp if sequence_parallel else 1
    lse = 4 * config.n_head / tp
    if checkpointing == "selective":  # what `lit3d.strategies.recompute` keeps: matmul, attention, collective outputs
        sharded = 2 * h + 2 * kv + 2 * f  # q, k, v, the attention output, gate and up
        rowwise = 2 * h  # o_proj and down_proj outputs, before their reduction
        reduced = 2 * h / split if tp > 1 else 0  # the all-reduce (SP: reduce-scatter) outputs
        gathered = 2 * h if sequence_parallel else 0  # SP: the all-gathered inputs of both regions
        return a * (h / split + sharded / tp + rowwise + reduced + gathered) + lse
    if checkpointing:
        return a * h / split  # only the block's input; the rest is recomputed
    norms = 4 * 2 * (2 * h + 1)  # per norm, in fp32: its input, the input times 1/rms, and 1/rms
    linear_inputs = a * 2 * h  # the norms' outputs in the compute dtype; under SP their shard (`KeepSequenceShard`)
    attention = a * ((h + 2 * kv) + h) + 4 * config.n_head  # rotated q, k and v; the output; the log-sum-exp
    mlp = a * 4 * f  # gate, up, silu(gate), their product
    return (norms + linear_inputs) / split + (attention + mlp) / tp


def autocast_weight_bytes(config: GPTConfig, tp: int) -> int:
    """What autocast keeps per block where the parameters are fp32 in forward (bf16-mixed without FSDP2's cast:
    DDP, no data parallelism): the bf16 copy of every weight it cast, saved for backward."""
    h, f, kv = config.d_model, config.d_ff, config.n_kv_head * config.head_dim
    return 2 * (2 * h * h + 2 * h * kv + 3 * h * f) // tp


def output_layer_bytes(config: GPTConfig, tp: int, sequence_parallel: bool, tokens: int, activations: int) -> float:
    """What the final norm and the loss keep for backward: the norm's fp32 tensors as in a block and its output in
    the compute dtype (the head's input), and the fp32 log-probabilities of the (vocabulary-split) logits."""
    norm = 4 * (2 * config.d_model + 1) + activations * config.d_model
    return tokens * (norm / (tp if sequence_parallel else 1) + config.padded_vocab_size / tp * 4)


def params_cast_by_fsdp(layout: Layout, zero_stage: int, precision: Precision) -> bool:
    """Whether FSDP2 hands the blocks bf16 parameters (its mixed precision policy): ZeRO-2/3, and ZeRO-0 unless
    it is DDP (`lit3d.strategies.precision.uses_ddp`)."""
    if layout.replicas == 1 or zero_stage == 1:
        return False
    return zero_stage >= 2 or layout.tp > 1 or layout.pp > 1 or precision.reduce_bytes < 4


def estimate(config: GPTConfig, cluster: Cluster, layout: Layout, training: Training) -> Plan:
    """Memory, communication, bubble and step time of ``layout`` (no checks: see `search.layout_problem`)."""
    precision = held_precision(training, layout)
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    virtual = training.virtual_pipeline_size if pp > 1 else 1
    b, s = training.micro_batch_size, training.seq_len
    microbatches = training.global_batch_size // (layout.data_replicas * b)  # per replica (of every island)
    schedule_m = microbatches // training.schedules_per_step(pp)  # micro-batches of one pipeline schedule
    sp = training.sequence_parallel and tp > 1
    tokens = b * s // layout.cp  # a rank's, per micro-batch

    a = precision.activations
    per_token = activation_bytes_per_token(config, tp, sp, training.activation_checkpointing, a)
    full_recompute = training.activation_checkpointing in (True, "full")
    # Mixed precision with fp32 parameters in forward: autocast's bf16 weight copies, one per block per step.
    copies = precision.weights > a and not training.activation_checkpointing
    copies = copies and not params_cast_by_fsdp(layout, training.zero_stage, precision)
    weight_copies = autocast_weight_bytes(config, tp) if copies else 0
    by_stage, params_per_rank = [], 0
    placement = SCHEDULES[training.pipeline_schedule].placement  # which chunks each pipeline rank holds
    summed = microbatches > 1  # gradients summed over micro-steps (accumulation) or a pipeline's micro-batches
    # Whole gradients before backward starts: DDP's buckets, the parameters' sums of earlier micro-steps, or both.
    ddp = layout.replicas > 1 and training.zero_stage == 0 and not params_cast_by_fsdp(layout, 0, precision)
    grads_from_start = int(ddp) + int(summed and (training.zero_stage == 0 or layout.replicas == 1))
    key = config_key(config)
    for stage_rank in range(pp):
        held = _stage_state(key, layout, virtual, stage_rank, placement, training.zero_stage, precision, summed)
        memory, layers, holds_head, transient = dict(held[0]), *held[1:]
        params_per_rank = max(params_per_rank, memory["params"] // precision.weights)
        in_flight = peak_in_flight(training.pipeline_schedule, pp, schedule_m, virtual, stage_rank)
        acts = layers * (per_token * tokens * in_flight + weight_copies)
        if full_recompute:  # one block recomputed at a time, for one micro-batch
            acts += activation_bytes_per_token(config, tp, sp, False, a) * tokens
        if holds_head:
            losses = in_flight if pp == 1 else last_stage_in_flight(training.pipeline_schedule, pp, schedule_m)
            acts += output_layer_bytes(config, tp, sp, tokens * losses, a)
        memory["activations"] = int(acts)
        memory["buffers"], memory["total"] = peak_memory(memory, transient, grads_from_start)
        by_stage.append(memory)
    peak = max(by_stage, key=lambda m: m["total"])

    # Communication per GPU per step, and the time it takes on its link.
    traffic = communication_bytes(config, layout, training, precision)
    cp = layout.cp
    spans = {"tp": tp, "cp": tp * cp, "dp": tp * cp * dp, "pp": layout.island_size, "ep": tp * cp * layout.ep}
    links = {
        axis: cluster.intra_node_gbps if span <= cluster.gpus_per_node else cluster.inter_node_gbps
        for axis, span in spans.items()
    }
    links["tp"] = cluster.intra_node_gbps if cluster.gpus_per_node % tp == 0 else cluster.inter_node_gbps
    intra = {axis: links[axis] == cluster.intra_node_gbps for axis in links}
    counts = collectives(config, layout, training)
    latency = {
        axis: (n * cluster.collective_latency_us + hops * (cluster.intra_node_hop_us if intra[axis] else
               cluster.inter_node_hop_us)) * 1e-6
        for axis, (n, hops) in counts.items()
        if axis != "island"
    }  # fmt: skip
    if layout.islands > 1:  # DiLoCo's outer step crosses the link between islands
        links["island"] = cluster.inter_island_gbps
        n, hops = counts["island"]
        latency["island"] = n * cluster.collective_latency_us * 1e-6 + hops * cluster.inter_island_latency_ms * 1e-3
    seconds = {axis: traffic[axis] / (links[axis] * GB) + latency[axis] for axis in traffic}

    # Compute: model FLOPs per token (6 per weight of every matmul, plus attention), recompute on top with AC.
    model_flops = config.flops_per_token(s) * training.global_batch_size * s
    hardware_flops = model_flops * (8 / 6 if full_recompute else 1.0)
    compute = (
        hardware_flops / cluster.gpus_per_node / cluster.nodes / (cluster.peak_tflops * 1e12 * training.efficiency)
    )
    compute *= cluster.gpus / layout.world_size  # the layout may use fewer GPUs than the cluster has
    costs = Costs.of(training.activation_checkpointing)
    bubble = bubble_theory(training.pipeline_schedule, pp, schedule_m, virtual, costs) if pp > 1 else 0.0
    overlap = compute if training.zero_stage == 3 else compute * 2 / 3  # DP traffic hides behind backward
    # The ring's next K/V block travels while attention computes on this one: it hides behind attention only.
    attention = compute * config.attention_flops_per_token(s) / config.flops_per_token(s)
    hidden = {"cp": min(seconds["cp"], attention)}
    exposed = compute + seconds["tp"] + seconds["pp"] + seconds["ep"] + seconds["cp"] - hidden["cp"]
    # NOTE: the outer step waits for its all-reduce (nothing computes meanwhile): amortised over its inner steps.
    step = exposed / (1 - bubble) + max(0.0, seconds["dp"] - overlap) + seconds.get("island", 0.0)
    mfu = model_flops / layout.world_size / (step * cluster.peak_tflops * 1e12)
    fits = peak["total"] <= cluster.gpu_memory_gb * GB * (1 - training.headroom)
    return Plan(
        layout={
            "data_parallel_size": dp,
            "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp,
            "zero_stage": training.zero_stage,
            "virtual_pipeline_size": virtual,
            "expert_parallel_size": layout.ep,
            "context_parallel_size": cp,
            **({"islands": layout.islands, "sync_every": training.sync_every} if layout.islands > 1 else {}),
        },
        memory_per_gpu=peak,
        memory_by_stage=by_stage,
        communication_per_step={
            axis: {
                "bytes": traffic[axis],
                "seconds": seconds[axis],
                "latency_s": latency[axis],
                "link_gbps": links[axis],
                **({"hidden_s": hidden[axis]} if axis in hidden else {}),
            }
            for axis in traffic
        },
        pipeline_bubble=bubble,
        step_time_s=step,
        mfu=mfu,
        fits=fits,
        num_microbatches=schedule_m,
        flops_per_step=float(model_flops),
        params_total=_params_total(key),
        params_per_rank=params_per_rank,
        params_active=config.active_params,
        activation_bytes_per_layer=int(per_token * tokens + weight_copies),
        pipeline_schedule=training.pipeline_schedule if pp > 1 else None,
    )


@lru_cache(maxsize=64)
def _params_total(key: tuple) -> int:
    """Elements of the whole model (cached: the search weighs every schedule of every layout)."""
    return sum(local_numel(t, 1) for t in rank_tensors(GPTConfig(**dict(key)), 1, 1, 0))


@lru_cache(maxsize=4096)
def _stage_state(
    key: tuple,
    layout: Layout,
    virtual: int,
    stage_rank: int,
    placement: str,
    zero_stage: int,
    precision: Precision,
    summed: bool,
) -> tuple[tuple[tuple[str, int], ...], int, bool, Transient]:
    """What pipeline rank ``stage_rank`` holds whatever the schedule's micro-batches: its weights, gradients and
    optimizer state, its number of blocks, whether it holds the head, and what it holds for a moment only
    (`lit3d.planner.buffers`; ``summed``: gradients summed over micro-steps or a pipeline's micro-batches).

    NOTE: cached, as the planner weighs every schedule for each layout and these sums over the tensors dominate."""
    tensors = rank_tensors(GPTConfig(**dict(key)), layout.pp, virtual, stage_rank, placement)
    state = tuple(state_bytes(tensors, layout, zero_stage, precision).items())
    layers = len({t.block for t in tensors if t.block is not None})
    head = any(t.name.startswith("head") for t in tensors)
    return state, layers, head, transient_bytes(tensors, layout, zero_stage, precision, summed)
