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

import math
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase
from functools import lru_cache
from typing import Any

from lit3d.config import GPTConfig
from strategies.layout import Layout
from strategies.pipeline import block_costs, bubble_theory, chunk_stage_ids, partition

GB = 1e9


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter held as weights, gradients and optimizer state, and per stored activation."""

    weights: int
    grads: int
    optimizer: int
    activations: int


PRECISIONS = {
    "32-true": Precision(4, 4, 8, 4),  # fp32 everything; AdamW's two moments
    # The usual mixed-precision accounting (Megatron, DeepSpeed): bf16 weights and gradients for compute, fp32
    # master weights and both moments in the optimizer. lit3d's bf16-mixed keeps the fp32 weights as the
    # parameters themselves (4 + 4 + 8): the same 16 bytes per parameter, split differently.
    "bf16-mixed": Precision(2, 2, 12, 2),
    "bf16-true": Precision(2, 2, 4, 2),
}
# What a lit3d run itself holds (its bf16-mixed autocasts fp32 parameters), for the estimate logged at fit start.
RUNTIME_PRECISIONS = {**PRECISIONS, "bf16-mixed": Precision(4, 4, 8, 2), "16-mixed": Precision(4, 4, 8, 2)}


@dataclass
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    intra_node_gbps: float = 450.0  # NVLink, GB/s per direction
    inter_node_gbps: float = 50.0  # InfiniBand share of one GPU, GB/s
    peak_tflops: float = 989.0  # dense bf16

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Training:
    seq_len: int = 2048
    micro_batch_size: int = 1
    global_batch_size: int = 512  # sequences per optimizer step
    precision: str = "bf16-mixed"
    zero_stage: int = 1
    sequence_parallel: bool = True
    activation_checkpointing: bool | str = False  # True or "full", "selective"
    pipeline_schedule: str = "1f1b"
    virtual_pipeline_size: int = 1
    efficiency: float = 0.6  # share of the peak that matmuls reach
    headroom: float = 0.1  # of GPU memory kept free for the allocator, CUDA context and buffers


@dataclass
class Plan:
    layout: dict[str, int]
    memory_per_gpu: dict[str, int]  # bytes on the most loaded rank
    communication_per_step: dict[str, dict[str, float]]  # per axis: bytes (per GPU) and seconds
    pipeline_bubble: float
    step_time_s: float
    mfu: float
    fits: bool
    num_microbatches: int
    memory_by_stage: list[dict[str, int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # the dim tensor parallelism splits, None when replicated
    block: int | None  # decoder block index; None for embedding, final norm, head


def parameter_table(config: GPTConfig) -> tuple[Tensor, ...]:
    """Every parameter tensor of the model: name, shape, the dim TP splits, its block."""
    return _parameter_table(_key(config))


@lru_cache(maxsize=16)
def _parameter_table(fields: tuple[tuple[str, Any], ...]) -> tuple[Tensor, ...]:
    import torch

    from lit3d.model import TENSOR_PARALLEL_PLAN, Transformer

    dims = {"colwise": 0, "vocab_head": 0, "vocab_embedding": 0, "rowwise": 1}
    with torch.device("meta"):
        network = Transformer(GPTConfig(**dict(fields)))
    table = []
    for name, param in network.named_parameters():
        module = name.rsplit(".", 1)[0]
        roles = [role for pattern, role in TENSOR_PARALLEL_PLAN.items() if fnmatchcase(module, pattern)]
        block = int(name.split(".")[1]) if name.startswith("blocks.") else None
        table.append(Tensor(name, tuple(param.shape), dims.get(roles[0]) if roles else None, block))
    return tuple(table)


def stage_blocks(config: GPTConfig, chunks: int) -> tuple[tuple[int, ...], ...]:
    """Blocks of each pipeline chunk, as the strategy splits them."""
    return _stage_blocks(_key(config), chunks)


@lru_cache(maxsize=64)
def _stage_blocks(key: tuple[tuple[str, Any], ...], chunks: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(run) for run in partition(*block_costs(GPTConfig(**dict(key))), chunks))


def rank_tensors(config: GPTConfig, pp: int, virtual: int, stage_rank: int) -> list[Tensor]:
    """The parameters pipeline rank ``stage_rank`` holds (its chunks' blocks, embedding/head on the ends)."""
    return list(_rank_tensors(_key(config), pp, virtual, stage_rank))


def _key(config: GPTConfig) -> tuple[tuple[str, Any], ...]:
    """A hashable stand-in for a (mutable, so unhashable) config, for the caches."""
    return tuple(sorted(config.to_dict().items()))


@lru_cache(maxsize=1024)
def _rank_tensors(key: tuple[tuple[str, Any], ...], pp: int, virtual: int, stage_rank: int) -> tuple[Tensor, ...]:
    config = GPTConfig(**dict(key))
    chunks = pp * virtual
    stage_ids = chunk_stage_ids(stage_rank, pp, virtual) if pp > 1 else [0]
    runs = stage_blocks(config, chunks) if pp > 1 else (tuple(range(config.n_layer)),)
    blocks = {b for s in stage_ids for b in runs[s]}
    first, last = 0 in stage_ids, chunks - 1 in stage_ids
    kept = []
    for tensor in parameter_table(config):
        if tensor.block is not None:
            keep = tensor.block in blocks
        else:
            keep = first if tensor.name.startswith("embed") else last
        if keep:
            kept.append(tensor)
    return tuple(kept)


def local_numel(tensor: Tensor, tp: int, shard: int = 1, shard_dim: int = 0) -> int:
    """Elements rank 0 of ``shard`` data-parallel ranks holds (torch.chunk's split, as DTensor's Shard)."""
    shape = list(tensor.shape)
    if tensor.tp_dim is not None:
        shape[tensor.tp_dim] //= tp
    shape[shard_dim] = -(-shape[shard_dim] // shard)
    return math.prod(shape)


def state_bytes(tensors: list[Tensor], layout: Layout, zero_stage: int, precision: Precision) -> dict[str, int]:
    """Weights, gradients and optimizer state of one rank (rank 0 of its TP and DP groups)."""
    tp, dp = layout.tp, layout.dp
    full = sum(local_numel(t, tp) for t in tensors)
    sharded_params = sum(local_numel(t, tp, dp) for t in tensors) if zero_stage >= 2 and dp > 1 else full
    if zero_stage >= 1 and dp > 1:  # ZeRO-1 slices a dim TP leaves whole; FSDP (2, 3) shards dim 0
        optimizer = sum(local_numel(t, tp, dp, _free_dim(t)) for t in tensors) if zero_stage == 1 else sharded_params
    else:
        optimizer = full
    step_counters = 4 * len(tensors)  # AdamW keeps one fp32 step count per tensor
    return {"params": sharded_params * precision.weights, "grads": sharded_params * precision.grads,
            "optimizer": optimizer * precision.optimizer + step_counters}


def _free_dim(tensor: Tensor) -> int:
    return next(d for d in range(len(tensor.shape)) if d != tensor.tp_dim)


def activation_elements_per_token(config: GPTConfig, tp: int, sequence_parallel: bool,
                                  checkpointing: bool | str) -> float:
    """Activations one block keeps for backward, per token (elements)."""
    h, f, kv = config.d_model, config.d_ff, config.n_kv_head * config.head_dim
    split = tp if sequence_parallel else 1
    if checkpointing == "selective":  # the input, the matmul, attention and collective outputs (strategies.recompute)
        return 3 * h / split + (h + 2 * kv + h + 2 * f) / tp
    if checkpointing:
        return h / split  # only the block's input; the rest is recomputed
    norm_inputs = 2 * h  # attention and MLP norms (split along the sequence under SP)
    linear_inputs = 2 * h  # normalised inputs of the column-parallel linears (gathered, so whole)
    per_head = (h + 2 * kv) + (h + kv) + h  # q, k, v; rotated q, k; attention output
    mlp = 4 * f  # gate, up, silu(gate), their product
    return norm_inputs / split + linear_inputs + (per_head + mlp) / tp


def estimate(config: GPTConfig, cluster: Cluster, layout: Layout, training: Training,
             precision: Precision | None = None) -> Plan:
    """Memory, communication, bubble and step time of ``layout`` (no checks: see `search.layout_problem`).

    ``precision`` overrides the bytes per element that ``training.precision`` stands for."""
    precision = precision or PRECISIONS[training.precision]
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    virtual = training.virtual_pipeline_size if pp > 1 else 1
    b, s = training.micro_batch_size, training.seq_len
    microbatches = training.global_batch_size // (dp * b)
    sp = training.sequence_parallel and tp > 1
    tokens = b * s  # per micro-batch

    per_token = activation_elements_per_token(config, tp, sp, training.activation_checkpointing)
    full_recompute = training.activation_checkpointing in (True, "full")
    by_stage = []
    for stage_rank in range(pp):
        tensors = rank_tensors(config, pp, virtual, stage_rank)
        memory = state_bytes(tensors, layout, training.zero_stage, precision)
        layers = len({t.block for t in tensors if t.block is not None})
        in_flight = _in_flight(training.pipeline_schedule, pp, virtual, microbatches, stage_rank)
        acts = layers * per_token * tokens * in_flight
        if full_recompute:  # one block recomputed at a time, for one micro-batch
            acts += activation_elements_per_token(config, tp, sp, False) * tokens
        if any(t.name.startswith("head") for t in tensors):  # fp32 logits and their gradient, vocab-split
            acts += 2 * tokens * config.padded_vocab_size / tp * 4 / precision.activations
        memory["activations"] = int(acts * precision.activations)
        memory["buffers"] = _buffer_bytes(tensors, layout, training.zero_stage, precision)
        memory["total"] = sum(memory.values())
        by_stage.append(memory)
    peak = max(by_stage, key=lambda m: m["total"])

    # Communication per GPU per step, and the time it takes on its link.
    traffic = communication_bytes(config, layout, training, precision)
    links = {
        "tp": cluster.intra_node_gbps if cluster.gpus_per_node % tp == 0 else cluster.inter_node_gbps,
        "pp": cluster.intra_node_gbps if tp * dp * pp <= cluster.gpus_per_node else cluster.inter_node_gbps,
        "dp": cluster.intra_node_gbps if tp * dp <= cluster.gpus_per_node else cluster.inter_node_gbps,
    }
    seconds = {axis: traffic[axis] / (links[axis] * GB) for axis in traffic}

    # Compute: model FLOPs per token (6 per weight of every matmul, plus attention), recompute on top with AC.
    model_flops = config.flops_per_token(s) * training.global_batch_size * s
    hardware_flops = model_flops * (8 / 6 if full_recompute else 1.0)
    compute = hardware_flops / cluster.gpus_per_node / cluster.nodes / (cluster.peak_tflops * 1e12 * training.efficiency)
    compute *= cluster.gpus / layout.world_size  # the layout may use fewer GPUs than the cluster has
    bubble = bubble_theory(training.pipeline_schedule, pp, microbatches, virtual) if pp > 1 else 0.0
    overlap = compute if training.zero_stage == 3 else compute * 2 / 3  # DP traffic hides behind backward
    step = (compute + seconds["tp"] + seconds["pp"]) / (1 - bubble) + max(0.0, seconds["dp"] - overlap)
    mfu = model_flops / layout.world_size / (step * cluster.peak_tflops * 1e12)
    fits = peak["total"] <= cluster.gpu_memory_gb * GB * (1 - training.headroom)
    return Plan(
        layout={"data_parallel_size": dp, "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                "zero_stage": training.zero_stage, "virtual_pipeline_size": virtual},
        memory_per_gpu=peak, memory_by_stage=by_stage,
        communication_per_step={axis: {"bytes": traffic[axis], "seconds": seconds[axis], "link_gbps": links[axis]}
                                for axis in traffic},
        pipeline_bubble=bubble, step_time_s=step, mfu=mfu, fits=fits, num_microbatches=microbatches,
    )


def _in_flight(schedule: str, pp: int, virtual: int, microbatches: int, stage_rank: int) -> float:
    """Micro-batches whose activations a stage holds at its peak."""
    if pp == 1:
        return 1.0  # gradient accumulation runs one micro-batch at a time
    if schedule == "gpipe":
        return float(microbatches)
    held = min(microbatches, pp - stage_rank)  # 1F1B: the first stage holds p, the last one
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        return held * (1 + (pp - 1) / (pp * virtual))  # Narayanan et al. (2021)
    return float(held)


def _buffer_bytes(tensors: list[Tensor], layout: Layout, zero_stage: int, precision: Precision) -> int:
    """Gathered parameters that sharded data parallelism holds during a step."""
    if layout.dp == 1 or zero_stage < 2:
        return 0
    gathered = sum(local_numel(t, layout.tp) - local_numel(t, layout.tp, layout.dp) for t in tensors)
    if zero_stage == 3:  # one block at a time and the next one prefetched, and the root (gathered for the step)
        blocks = {t.block for t in tensors if t.block is not None} or {None}
        gathered = 2 * max(sum(local_numel(t, layout.tp) for t in tensors if t.block == b) for b in blocks)
        gathered += sum(local_numel(t, layout.tp) - local_numel(t, layout.tp, layout.dp)
                        for t in tensors if t.block is None)
    return int(gathered * precision.weights)


def communication_bytes(config: GPTConfig, layout: Layout, training: Training,
                        precision: Precision) -> dict[str, float]:
    """Bytes the busiest GPU of each axis sends per optimizer step, counted as a ring sends them: an all-reduce
    2 (n-1)/n of its tensor, an all-gather or reduce-scatter (n-1)/n of the full tensor, a point-to-point send
    all of it. `strategies.comm.CommBytes` measures the same way (`lit3d.callbacks.CommReport` puts both side by
    side). Left out: scalars (the logged loss, the gradient norm).
    """
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    virtual = training.virtual_pipeline_size if pp > 1 else 1
    microbatches = training.global_batch_size // (dp * training.micro_batch_size)
    sp = training.sequence_parallel and tp > 1
    act_bytes = training.micro_batch_size * training.seq_len * config.d_model * precision.activations
    ring = 2 * (tp - 1) / tp  # all-reduce traffic per byte; SP's all-gather + reduce-scatter pair costs the same
    # Per block and micro-batch: 2 all-reduces forward (attention and MLP outputs) and 2 backward (their inputs'
    # gradients). Full recompute reruns the forward up to the last tensor backward needs: the attention
    # all-reduce, and under SP also the MLP's all-gather (PyTorch's checkpoint stops early).
    per_block = 4 + (1.5 if sp else 1.0) * (training.activation_checkpointing in (True, "full"))
    traffic = {"tp": 0.0, "pp": 0.0, "dp": 0.0}
    for stage_rank in range(pp):
        tensors = rank_tensors(config, pp, virtual, stage_rank)
        stage_ids = chunk_stage_ids(stage_rank, pp, virtual) if pp > 1 else [0]
        first, last = 0 in stage_ids, pp * virtual - 1 in stage_ids
        blocks = len({t.block for t in tensors} - {None})
        tp_bytes = (blocks * per_block + first + last) * act_bytes  # embedding (fwd) and head (bwd): one each
        if last:  # the vocabulary-parallel loss: 3 fp32 all-reduces per token (max, sum, target logit)
            tp_bytes += 3 * training.micro_batch_size * training.seq_len * 4
        tp_bytes *= microbatches
        if sp:  # SP norms see part of the sequence, so their weights' gradients are all-reduced after each backward
            norms = sum(local_numel(t, tp) for t in tensors if "norm" in t.name) * precision.grads
            tp_bytes += norms * (1 if pp > 1 else microbatches)  # a pipeline's backward spans all micro-batches
        traffic["tp"] = max(traffic["tp"], ring * tp_bytes)
        root = sum(local_numel(t, tp) for t in tensors if t.block is None)  # embedding, final norm, head
        in_blocks = sum(local_numel(t, tp) for t in tensors if t.block is not None)
        sent = _dp_traffic(training.zero_stage, dp, in_blocks, root, microbatches, pp > 1, precision)
        traffic["dp"] = max(traffic["dp"], sent)
    if pp > 1:
        # Each chunk sends its output forward and its input's gradient backward; the first chunk has no
        # input and the last no output, so the middle ranks send the most, and with two ranks each sends 2v-1.
        sends = 2 * virtual - (pp == 2)
        traffic["pp"] = sends * microbatches * act_bytes / (tp if sp else 1)
    return traffic


def _dp_traffic(zero_stage: int, dp: int, in_blocks: int, root: int, microbatches: int, pipelined: bool,
                precision: Precision) -> float:
    """Bytes a GPU sends per step to synchronise its parameters (``in_blocks`` + ``root``) over ``dp`` replicas.

    Gradients go once per step (not on the micro-steps before it). ZeRO-2 gathers the weights once per step and
    keeps them. ZeRO-3 gathers each block for every forward and backward of a micro-batch, and the root
    (embedding, final norm, head; not resharded after forward, since backward starts there) once per micro-batch.
    A pipeline schedule keeps a chunk gathered after each backward but the last, so only the backwards right
    after a forward gather again: m + 1 gathers of the blocks per step, whatever the order, and one of the root.
    """
    if dp == 1:
        return 0.0
    share = (dp - 1) / dp
    params = in_blocks + root
    grads, weights = params * precision.grads, params * precision.weights
    if zero_stage < 3:
        return {
            0: 2 * share * grads,  # all-reduce of the gradients
            1: 2 * share * grads + share * weights,  # all-reduce, then all-gather of the updated slices
            2: share * (grads + weights),  # reduce-scatter of gradients, all-gather of weights
        }[zero_stage]
    gathers = (microbatches + 1, 1) if pipelined else (2 * microbatches, microbatches)  # blocks, root
    return share * (grads + (gathers[0] * in_blocks + gathers[1] * root) * precision.weights)
