"""What crosses a rank's host link in a step, and the seconds it adds: ZeRO-3 offload's states (FSDP2 copies them on
the compute stream) and a stack's offloaded activations (`Software.offloaded_layers`, copied beside the compute)."""

from __future__ import annotations

from lit3d.models.config import GPTConfig
from lit3d.parallel.layout import Layout
from lit3d.parallel.settings import Parallelism
from lit3d.parallel.zero import ZeroPolicy
from lit3d.planner.block_saves import repeated_kv_share
from lit3d.planner.inputs import GB, Cluster, Precision, Training
from lit3d.planner.memory import activation_bytes_per_token
from lit3d.planner.tensors import local_numel, rank_tensors, replicas, stepped_numel


def offloaded_states(
    config: GPTConfig,
    layout: Layout,
    settings: Parallelism,
    training: Training,
    rank: int,
    virtual: int,
    placement: str,
    cluster: Cluster,
    precision: Precision,
) -> tuple[float, float]:
    """(host transfers, CPU optimizer step) in seconds per step under ZeRO-3 with offload: every gather of a micro-
    batch's forward and backward first copies the rank's shards to the device, the step's gradient reduction copies
    its shards back, and AdamW steps in host memory; none of it overlapped (FSDP2 copies on the compute stream)."""
    tensors = rank_tensors(config, layout.pp, virtual, rank, placement, training.lora, settings.pipeline_stage_layers)
    shards = {
        train: sum(
            local_numel(t, layout.tp, replicas(t, layout), ep=layout.ep) for t in tensors if t.trains or not train
        )
        for train in (False, True)
    }
    microbatches = training.global_batch_size // (layout.data_replicas * training.micro_batch_size)
    reductions = training.schedules_per_step(layout.pp)  # gradients sync once per step (or pipeline schedule)
    copied = 2 * microbatches * shards[False] * precision.weights + reductions * shards[True] * precision.grads
    stepped = stepped_numel(tensors, layout, ZeroPolicy.of(settings, layout))
    return copied / (cluster.host_link_gbps * GB), stepped / (cluster.host_adamw_gparams * 1e9)


def offloaded_activations(
    config: GPTConfig,
    layout: Layout,
    training: Training,
    settings: Parallelism,
    cluster: Cluster,
    precision: Precision,
    compute: float,
) -> float:
    """Seconds a step waits on `Software.offloaded_layers`: each such block's saved activations go out to the host
    in forward and come back in backward, on their own stream beside ``compute`` (the step's, a third of it forward,
    two thirds backward), so only what outlasts the compute of its pass shows."""
    software = training.software
    sp = settings.sequence_parallel and layout.tp > 1
    per_token = activation_bytes_per_token(
        config, layout.tp, sp, settings.activation_checkpointing, precision.activations, training.lora,
        software.kept_for_backward(settings.compile, bool(config.n_expert)), software.recomputed_matmuls,
        software.fp8_saved_inputs and settings.float8 is not None,
        repeated_kv_share(config, cluster.gpu.device == "GPU", training.document_length is not None),
    )  # fmt: skip
    tokens = training.micro_batch_size * training.seq_len // layout.cp
    microbatches = training.global_batch_size // (layout.data_replicas * training.micro_batch_size)
    blocks = min(software.offloaded_layers, -(-config.n_layer // layout.pp))
    one_way = blocks * per_token * tokens * microbatches / (cluster.host_link_gbps * GB)
    return max(0.0, one_way - compute / 3) + max(0.0, one_way - 2 * compute / 3)
