"""The planner's clock: one optimizer step's time on the busiest rank, kernel class by kernel class.

- Matmuls: each GEMM's FLOPs at the device's GEMM efficiency, lowered for a short inner dimension (each output tile
  then does less work per load and store of it: `Efficiencies.gemm_half_dim`), or its bytes over memory bandwidth if
  that is longer.
- Attention: its causal FLOPs at the attention kernel's own forward and backward efficiency.
- Memory-bound work (norms, rotary, SwiGLU, residuals, the loss over the vocabulary, the optimizer step): bytes
  moved over the memory bandwidth it reaches, plus a fixed time per kernel.
- Recompute: the forward again, or the share of it that the recompute policy reruns.
- Communication: tensor, expert and pipeline traffic waits (TP less what asynchronous TP hides), the CP ring hides
  behind attention, data-parallel traffic behind the compute it can overlap (FSDP's prefetched gathers behind every
  forward and backward, gradient reductions behind the last backward); what hides still slows the compute a little
  (`Efficiencies.overlap_cost`). The pipeline's bubble stretches what its stages run.
- A power cap below the board's rating lowers the tensor-core clock (`lit3d.planner.calibration.STATIC_POWER_SHARE`).

Its constants are in `lit3d.planner.calibration`; `benchmarks/planner_vs_published.py` checks it against published runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from lit3d.models.config import GPTConfig
from lit3d.parallel.layout import Layout
from lit3d.parallel.schedules import SCHEDULES, Costs, bubble_theory
from lit3d.parallel.settings import Parallelism
from lit3d.parallel.zero import ZeroPolicy
from lit3d.planner.calibration import (
    ATTENTION_BACKWARD_FLOPS,
    BACKWARD_ELEMENTWISE,
    FP8_CAST_BYTES,
    OPTIMIZER_BYTES,
    OPTIMIZER_OPS,
    STATIC_POWER_SHARE,
    Efficiencies,
)
from lit3d.planner.host import offloaded_activations, offloaded_states
from lit3d.planner.inputs import GB, Case, Cluster, Precision, Software, Training
from lit3d.planner.sums import StageSums, rank_sums
from lit3d.planner.tensors import adapter_params, config_of, lora_of
from lit3d.planner.traffic import tp_bytes_by_stage
from lit3d.planner.work import Gemm, Work, stage_work


@dataclass(frozen=True)
class StepTime:
    step: float  # seconds per optimizer step
    bubble: float  # the pipeline's idle share
    microbatches: int  # of one pipeline schedule
    model_flops: float  # of one optimizer step, all GPUs (recompute not counted)
    hidden: dict[str, float]  # seconds of each axis's traffic hidden behind compute
    # Seconds of the step by kind, summing to ``step``: compute (matmuls and attention, recompute included),
    # memory_bound, exposed_communication (per axis), bubble, optimizer, overhead (the host's, between steps).
    breakdown: dict
    seconds: dict[str, float] | None = None  # each axis's traffic time as priced, where it differs (a fleet's TP)


@dataclass(frozen=True)
class Device:
    """What the clock prices kernels with: one rank's device at the run's power."""

    flops: float  # the dense peak at the clock the power cap allows, FLOP/s
    bandwidth: float  # memory bytes/s a streaming kernel reaches
    efficiency: Efficiencies  # its kernels' (`lit3d.planner.calibration`)
    element: int  # bytes of an activation
    fp8_flops: float = 0.0  # the FP8 peak likewise (the bf16 one where the device has no FP8 tensor cores)
    cast_bytes: float = FP8_CAST_BYTES  # moved per element of an FP8 operand to cast it (`Software.fp8_cast_bytes`)

    @classmethod
    def of(cls, cluster: Cluster, element: int) -> Device:
        efficiency = cluster.gpu.efficiency
        flops = cluster.peak_tflops * 1e12 * power_clock(cluster.power_watts, cluster.gpu.tdp_watts)
        bandwidth = cluster.gpu.memory_bandwidth_gbps * 1e9 * efficiency.memory
        fp8 = flops * max(1.0, cluster.gpu.fp8_tflops / cluster.gpu.peak_tflops)  # (a given peak_tflops scales it)
        return cls(flops, bandwidth, efficiency, element, fp8)

    def gemm(self, gemm: Gemm) -> float:
        efficiency = self.efficiency
        share = efficiency.gemm * gemm.k / (gemm.k + efficiency.gemm_half_dim)
        operands = (gemm.m * gemm.k + gemm.k * gemm.n) * gemm.count
        if gemm.fp8:  # one-byte operands, each cast first by its own kernels (`FP8_CAST_BYTES`)
            moved = operands + self.element * gemm.m * gemm.n * gemm.count
            compute = max(gemm.flops / (self.fp8_flops * share), moved / self.bandwidth)
            return compute + self.cast_bytes * operands / self.bandwidth
        moved = self.element * (operands + gemm.m * gemm.n * gemm.count)
        return max(gemm.flops / (self.flops * share), moved / self.bandwidth)

    def kernels(self, count: float) -> float:
        return count * self.efficiency.kernel_overhead_us * 1e-6


def power_clock(power_watts: float | None, tdp_watts: float) -> float:
    """The share of its rated tensor-core clock a device keeps under a power cap: dynamic power goes as the clock
    cubed above a static share (`STATIC_POWER_SHARE`)."""
    if power_watts is None or power_watts >= tdp_watts:
        return 1.0
    static = STATIC_POWER_SHARE * tdp_watts
    return max(0.0, (power_watts - static) / (tdp_watts - static)) ** (1 / 3)


def micro_batch_time(work: Work, device: Device, software: Software, recompute: tuple[float, bool]) -> dict:
    """Seconds of one micro-batch's forward and backward on a rank: compute (GEMMs, attention) and memory-bound
    work (elementwise, loss, embedding, kernel overheads); ``software``: the run's kernels; ``recompute``: the share of
    the blocks' forward matmuls and attention run again, and whether their elementwise work is."""
    if software.fp8_cast_bytes is not None:
        device = replace(device, cast_bytes=software.fp8_cast_bytes)
    forward_attention, backward_attention = device.efficiency.attention_efficiency(software.attention)
    gemm_forward = sum(device.gemm(g) for g in work.block_gemms)
    gemm_backward = sum(device.gemm(b) for g in work.block_gemms for b in g.backward())
    attention_forward = work.attention_flops / (device.flops * forward_attention)
    attention_backward = ATTENTION_BACKWARD_FLOPS * work.attention_flops / (device.flops * backward_attention)
    head = sum(device.gemm(g) + sum(device.gemm(b) for b in g.backward()) for g in work.head_gemms)
    matmuls, again = recompute
    compute = gemm_forward + gemm_backward + attention_forward + attention_backward + head
    compute += matmuls * (gemm_forward + attention_forward)
    passes = 1 + BACKWARD_ELEMENTWISE + again
    gemm_kernels = sum(g.count for g in (*work.block_gemms, *work.head_gemms)) * (3 + matmuls)
    memory = passes * work.block_bytes / device.bandwidth + work.other_bytes / device.bandwidth
    memory += device.kernels(passes * work.block_kernels + work.other_kernels + gemm_kernels + 2 * work.blocks)
    if work.split:  # the host's work per tensor-parallel linear, forward and backward (DTensor's)
        linears = sum(g.count for g in (*work.block_gemms, *work.head_gemms))
        memory += linears * device.efficiency.split_linear_us * 1e-6
    return {"compute": compute, "memory_bound": memory, "attention": attention_forward + attention_backward}


def recompute_of(settings: Parallelism, training: Training) -> tuple[float, bool]:
    """(share of the forward's matmuls recomputed, whether elementwise work is) for the run's policy."""
    policy = settings.activation_checkpointing
    matmuls = 1.0 if policy in (True, "full") else 0.0
    if training.software.recomputed_matmuls is not None and policy:
        matmuls = training.software.recomputed_matmuls
    return matmuls, bool(policy)


def step_time(case: Case, traffic: dict, seconds: dict[str, float], work: RankWork, muon: float = 0.0) -> StepTime:
    """The step of ``case`` on its busiest rank: ``traffic`` the bytes each axis sends, ``seconds`` the time they
    take, ``work`` what each pipeline rank computes (`rank_work`); ``muon``: the seconds of Muon's gathers (not in
    ``seconds``: nothing overlaps them), priced with its iteration in the optimizer's step (`newton_schulz_time`)."""
    config, cluster, layout, training, settings = case.config, case.cluster, case.layout, case.training, case.settings
    precision, pp = case.precision, layout.pp
    microbatches = training.global_batch_size // (layout.data_replicas * training.micro_batch_size)  # per replica
    schedule_m = microbatches // training.schedules_per_step(pp)  # micro-batches of one pipeline schedule
    sp = settings.sequence_parallel and layout.tp > 1
    virtual = settings.chunks_per_rank if pp > 1 else 1
    placement = SCHEDULES[settings.pipeline_schedule].placement
    times = work.times
    rank = max(range(pp), key=lambda r: times[r]["compute"] + times[r]["memory_bound"])
    if cluster.stage_gpus is not None:  # a fleet: each stage sends its own TP traffic over its own NVLink
        rank, seconds = _busiest_in_fleet(case, times, seconds)
    busiest = times[rank]
    device = Device.of(cluster.stage(rank), precision.activations)  # (a fleet's stages run on their own GPUs)
    compute, memory = busiest["compute"] * microbatches, busiest["memory_bound"] * microbatches
    if sp and not training.software.sequence_first:  # each gather and scatter copies the whole tensor in or out
        memory += 4 * layout.tp / (2 * (layout.tp - 1)) * traffic["tp"] / device.bandwidth
    exposed, hidden = _exposed(seconds, training, busiest["attention"] * microbatches, cluster)
    bubble = 0.0
    if pp > 1:
        bubble = bubble_theory(
            settings.pipeline_schedule, pp, schedule_m, virtual, Costs.of(settings.activation_checkpointing)
        )
    pipelined = compute + memory + sum(exposed.values())
    idle = pipelined * bubble / (1 - bubble)
    zero = ZeroPolicy.of(settings, layout)
    gathered = _gathered_share(zero, precision)
    for axis in ("dp", "dp_shard"):  # (dp_shard: HSDP's shard groups)
        if axis in seconds:
            exposed[axis], hidden[axis] = _data_parallel(
                seconds[axis], zero, training, busiest, microbatches, gathered, cluster
            )
    if "dp_replicate" in seconds:  # HSDP: the groups' all-reduce of the gradients, overlapping backward as DDP's
        dp_replicate = _data_parallel(seconds["dp_replicate"], ZeroPolicy(0), training, busiest, 1, 0.0, cluster)
        exposed["dp_replicate"], hidden["dp_replicate"] = dp_replicate
    # NOTE: waited for: DiLoCo's outer step (amortised over its inner steps), the replica groups' average (pre-step)
    exposed.update({axis: seconds[axis] for axis in ("island", "replica") if axis in seconds})
    optimizer = _optimizer(*work.stepped[rank], device) + muon + newton_schulz_time(work, rank, device)
    if settings.offload:  # the states in host memory: copies over the host link, the optimizer on the CPU
        exposed["host"], optimizer = offloaded_states(
            config, layout, settings, training, rank, virtual, placement, cluster, precision
        )
    if training.software.offloaded_layers:  # saved activations out to the host and back, beside the compute
        exposed["host"] = exposed.get("host", 0.0) + offloaded_activations(
            config, layout, training, settings, cluster, precision, compute
        )
    overhead = cluster.gpu.efficiency.step_overhead_ms * 1e-3
    breakdown = {
        "compute": compute,
        "memory_bound": memory,
        "exposed_communication": exposed,
        "bubble": idle,
        "optimizer": optimizer,
        "overhead": overhead,
    }
    step = compute + memory + sum(exposed.values()) + idle + optimizer + overhead
    return StepTime(step, bubble, schedule_m, _model_flops(config, training), hidden, breakdown, seconds)


def _busiest_in_fleet(case: Case, times: list[dict], seconds: dict[str, float]) -> tuple[int, dict[str, float]]:
    """The pipeline rank of a fleet whose micro-batches and TP traffic take longest, and ``seconds`` with its TP time:
    ``seconds["tp"]`` is the most TP traffic's over the slowest NVLink; each stage's is its own bytes over its own
    (TP stays inside a node on a fleet), with the same latency."""
    layout, training, cluster = case.layout, case.training, case.cluster
    sent = tp_bytes_by_stage(case, rank_sums(case))
    microbatches = training.global_batch_size // (layout.data_replicas * training.micro_batch_size)
    latency = seconds["tp"] - max(sent) / _tp_link(cluster)
    tp = [n / _tp_link(cluster.stage(r)) + latency if n else 0.0 for r, n in enumerate(sent)]
    rank = max(range(layout.pp), key=lambda r: (times[r]["compute"] + times[r]["memory_bound"]) * microbatches + tp[r])
    return rank, {**seconds, "tp": tp[rank]}


def _tp_link(cluster: Cluster) -> float:
    """Bytes per second TP's collectives reach over a node's NVLink."""
    return cluster.intra_node_gbps * cluster.gpu.efficiency.link * GB


@dataclass(frozen=True)
class RankWork:
    """What each pipeline rank computes whatever its micro-batches: one micro-batch's times (compute, memory-bound
    work, attention: `micro_batch_times`), the elements and tensors its optimizer steps, and Muon's FLOPs."""

    times: list[dict]
    stepped: tuple[tuple[int, int], ...]
    newton_schulz: tuple[float, ...] = ()  # FLOPs of Muon's iteration per step (`lit3d.planner.sums.StageSums`)


def micro_batch_times(case: Case, sums: tuple[StageSums, ...]) -> list[dict]:
    """The times of one micro-batch on each pipeline rank (``sums``: theirs, `rank_sums`), each on its own device (a
    fleet's `Cluster.stage_gpus`)."""
    cluster, layout, training, settings = case.cluster, case.layout, case.training, case.settings
    element, (fused, sp) = case.precision.activations, _fused_and_sp(training, settings, layout)
    recompute, fp8 = recompute_of(settings, training), settings.float8 is not None
    batch = (training.micro_batch_size, training.seq_len)
    times: dict[tuple, dict] = {}  # NOTE: a long pipeline's middle stages hold alike: each is priced once
    for rank, stage in enumerate(sums):
        gpu = cluster.stage_gpus[rank] if cluster.stage_gpus else None
        if (stage, gpu) not in times:
            device = Device.of(cluster.stage(rank), element)
            seconds = _stage_seconds(
                case.key, layout, *batch, sp, fused, stage, fp8, device, training.software, recompute
            )
            times[stage, gpu] = dict(zip(("compute", "memory_bound", "attention"), seconds, strict=True))
    return [times[stage, cluster.stage_gpus[rank] if cluster.stage_gpus else None] for rank, stage in enumerate(sums)]


@lru_cache(maxsize=4096)
def _stage_seconds(
    key: tuple,
    layout: Layout,
    micro_batch_size: int,
    seq_len: int,
    sp: bool,
    fused: bool,
    stage: StageSums,
    fp8: bool,
    device: Device,
    software: Software,
    recompute: tuple[float, bool],
) -> tuple[float, ...]:
    """`micro_batch_time` of a rank of ``layout`` holding ``stage`` of the model a `config_key` stands for (cached: the
    search prices the same ranks' work at every ZeRO stage)."""
    work = stage_work(config_of(key), layout, micro_batch_size, seq_len, lora_of(key), sp, fused, stage, fp8)
    return tuple(micro_batch_time(work, device, software, recompute).values())


def stage_times(
    config: GPTConfig, cluster: Cluster, layout: Layout, training: Training, settings: Parallelism
) -> list[float]:
    """Seconds of one micro-batch's forward and backward on each pipeline rank (compute and memory-bound work)."""
    case = Case(config, cluster, layout, training, settings)
    return [t["compute"] + t["memory_bound"] for t in micro_batch_times(case, rank_sums(case))]


def _fused_and_sp(training: Training, settings: Parallelism, layout: Layout) -> tuple[bool, bool]:
    """Whether elementwise work is fused and whether sequence parallelism is on."""
    fused = bool(settings.compile) if training.software.fused is None else training.software.fused
    return fused, settings.sequence_parallel and layout.tp > 1


def _model_flops(config: GPTConfig, training: Training) -> float:
    """Model FLOPs of one optimizer step, all GPUs (recompute not counted)."""
    adapters = adapter_params(config, training.lora) if training.lora else None
    per_token = config.flops_per_token(training.seq_len, adapters)
    if training.document_length:  # packed documents: only the attention each keeps within itself
        kept = min(training.document_length, training.seq_len)
        per_token += config.attention_flops_per_token(kept) - config.attention_flops_per_token(training.seq_len)
    return per_token * training.global_batch_size * training.seq_len


def _exposed(
    seconds: dict[str, float], training: Training, attention: float, cluster: Cluster
) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of TP, PP, EP and CP traffic the busiest rank waits for, and the seconds hidden: the CP ring behind
    attention, TP's share that the run overlaps with its GEMMs (`Software.tp_overlap`); what hides costs
    `overlap_cost` of itself."""
    cost = cluster.gpu.efficiency.overlap_cost
    hidden = {"cp": min(seconds["cp"], attention)}
    hidden["tp"] = seconds["tp"] * training.software.tp_overlap
    exposed = {axis: seconds[axis] - hidden.get(axis, 0.0) * (1 - cost) for axis in ("tp", "pp", "ep", "cp")}
    return exposed, hidden


def _gathered_share(zero: ZeroPolicy, precision: Precision) -> float:
    """The share of ZeRO-1/2's data-parallel bytes that gathers weights (the rest reduces gradients)."""
    weights = precision.weights if zero.slices_optimizer else precision.gather_bytes
    return weights / (weights + precision.reduce_bytes)


def _data_parallel(
    dp_seconds: float,
    zero: ZeroPolicy,
    training: Training,
    busiest: dict,
    microbatches: int,
    gathered: float,
    cluster: Cluster,
) -> tuple[float, float]:
    """(exposed, hidden) seconds of data-parallel traffic. ZeRO-3's gathers and reductions overlap every forward
    and backward; otherwise the gradients' reduction overlaps the last micro-batch's backward (where the stack starts
    it during backward: `Software.overlap_grad_reduce`), and ZeRO-1/2's gather of the weights waits (Megatron overlaps
    it with the next forward: `Software.overlap_param_gather`)."""
    if dp_seconds == 0:
        return 0.0, 0.0
    per_micro_batch = busiest["compute"] + busiest["memory_bound"]
    backward, reducing = per_micro_batch * 2 / 3, training.software.overlap_grad_reduce
    if zero.reshards_after_forward:
        windows = [(dp_seconds, per_micro_batch * microbatches)]
    elif zero.all_reduces:
        windows = [(dp_seconds, backward if reducing else 0.0)]
    else:  # a reduce-scatter of the gradients and a gather of the weights, as many elements each
        gather = dp_seconds * gathered
        overlapped = training.software.overlap_param_gather or zero.shards_parameters  # (ZeRO-2: FSDP2 prefetches)
        windows = [(dp_seconds - gather, backward if reducing else 0.0)]
        windows.append((gather, per_micro_batch / 3 if overlapped else 0.0))
    cost = cluster.gpu.efficiency.overlap_cost
    hidden = sum(min(traffic, window) for traffic, window in windows)
    return dp_seconds - hidden * (1 - cost), hidden


def newton_schulz_time(work: RankWork, rank: int, device: Device) -> float:
    """Muon's Newton-Schulz products on pipeline rank ``rank`` (`RankWork.newton_schulz`), at the GEMM efficiency."""
    return work.newton_schulz[rank] / (device.flops * device.efficiency.gemm) if work.newton_schulz else 0.0


def _optimizer(numel: int, tensors: int, device: Device) -> float:
    """AdamW's step over what a rank's optimizer steps (``numel`` elements of ``tensors`` tensors), and clipping's
    norm: memory-bound."""
    return numel * OPTIMIZER_BYTES / device.bandwidth + device.kernels(tensors * OPTIMIZER_OPS)


def time_shares(breakdown: dict, step: float) -> dict[str, float]:
    """The step's shares by kind, each axis's exposed communication apart (``DP communication``), largest first."""
    seconds = {kind.replace("_", "-"): value for kind, value in breakdown.items() if kind != "exposed_communication"}
    for axis, value in breakdown["exposed_communication"].items():
        seconds[f"{axis.upper()} communication"] = value
    shares = {kind: value / step for kind, value in seconds.items() if value > 0}
    return dict(sorted(shares.items(), key=lambda item: -item[1]))


def largest_costs(breakdown: dict, step: float, top: int = 3) -> str:
    """``compute 72%, memory-bound 23%, optimizer 2%``: the step's largest costs."""
    shares = list(time_shares(breakdown, step).items())[:top]
    return ", ".join(f"{kind} {share:.0%}" for kind, share in shares)
