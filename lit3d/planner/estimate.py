"""Memory, communication, bubble and step time of one layout: arithmetic only, no GPU.

What is planned is described by three values: the `Cluster`, the training loop's numbers (`Training`) and the run's
settings, the `lit3d.parallel.Parallelism` the strategy is built from (its sizes resolved into a `Layout`).

Parameter shapes come from the model's config (the real model's, `lit3d.planner.shapes`), and each tensor's split
from the model's tensor-parallel plan, the strategy's pipeline partition and its ZeRO rules, so the per-rank counts
are exact (`lit3d plan --verify` checks them against the real parallelised model). Activations follow the per-layer
accounting of Korthikanti et al. (2022) for this architecture (RMSNorm, SwiGLU, grouped-query attention, fused
attention that stores no score matrix: `lit3d.planner.memory`). Step time is priced kernel class by kernel class,
with what communication hides and what it exposes (`lit3d.planner.clock`).
"""

from __future__ import annotations

from lit3d.models.config import GPTConfig
from lit3d.parallel.layout import Layout
from lit3d.parallel.settings import Parallelism
from lit3d.planner.clock import step_time
from lit3d.planner.inputs import (  # noqa: F401 (read from here too)
    GB,
    MASTER_WEIGHTS,
    PLANNING_DEFAULTS,
    PRECISIONS,
    Case,
    Cluster,
    Plan,
    Precision,
    Training,
    held_precision,
)
from lit3d.planner.memory import (  # noqa: F401 (the per-token counts are also read from here)
    Memory,
    activation_bytes_per_token,
    autocast_weight_bytes,
    memory_by_stage,
    output_layer_bytes,
)
from lit3d.planner.traffic import collectives, communication_bytes


def estimate(
    config: GPTConfig,
    cluster: Cluster,
    layout: Layout,
    training: Training,
    settings: Parallelism = PLANNING_DEFAULTS,
) -> Plan:
    """Memory, communication, bubble and step time of ``layout`` (no checks: see `search.layout_problem`).

    ``settings``: the run's; its sizes are ``layout``'s (those ``settings`` holds are not read)."""
    case = Case(config, cluster, layout, training, settings)  # passed whole from here down
    memory, traffic = memory_by_stage(case), communication_bytes(case)
    links = link_speeds(cluster, layout)
    latency = latencies(cluster, links, collectives(case))
    reached = cluster.gpu.efficiency.link  # of a link's rated bandwidth, by ring collectives
    seconds = {axis: traffic[axis] / (links[axis] * reached * GB) + latency[axis] for axis in traffic}
    time = step_time(case, traffic, seconds)
    seconds = time.seconds or seconds  # (a fleet's TP: the busiest stage's own bytes over its own NVLink)
    return Plan(
        layout=planned_layout(layout, settings),
        memory_per_gpu=memory.peak,
        memory_by_stage=memory.by_stage,
        communication_per_step={
            axis: {
                "bytes": traffic[axis],
                "seconds": seconds[axis],
                "latency_s": latency[axis],
                "link_gbps": links[axis],
                **({"hidden_s": time.hidden[axis]} if axis in time.hidden else {}),
            }
            for axis in traffic
        },
        pipeline_bubble=time.bubble,
        step_time_s=time.step,
        tokens_per_s_per_gpu=training.global_batch_size * training.seq_len / (time.step * layout.world_size),
        time_breakdown=time.breakdown,
        mfu=time.model_flops / layout.world_size / (time.step * mean_peak(cluster, layout.pp) * 1e12),
        fits=all(
            stage["total"] <= cluster.stage(rank).gpu_memory_gb * GB * (1 - training.headroom)
            for rank, stage in enumerate(memory.by_stage)
        ),
        num_microbatches=time.microbatches,
        flops_per_step=float(time.model_flops),
        params_total=config.num_params,
        params_per_rank=memory.params_per_rank,
        params_active=config.active_params,
        activation_bytes_per_layer=memory.activation_bytes_per_layer,
        pipeline_schedule=settings.pipeline_schedule if layout.pp > 1 else None,
    )


def mean_peak(cluster: Cluster, pp: int) -> float:
    """TFLOP/s of one GPU, averaged over a fleet's pipeline stages (each stage as many GPUs)."""
    return sum(cluster.stage(rank).peak_tflops for rank in range(pp)) / pp


def planned_layout(layout: Layout, settings: Parallelism) -> dict[str, int]:
    """The sizes and settings a plan reports under ``layout`` (``data_parallel_size``: one island's replicas)."""
    islands = {"islands": layout.islands, "sync_every": settings.sync_every} if layout.islands > 1 else {}
    return {
        "data_parallel_size": layout.dp,
        "tensor_parallel_size": layout.tp,
        "pipeline_parallel_size": layout.pp,
        "zero_stage": settings.zero_stage,
        "virtual_pipeline_size": settings.chunks_per_rank if layout.pp > 1 else 1,
        "expert_parallel_size": layout.ep,
        "context_parallel_size": layout.cp,
        **islands,
    }


def link_speeds(cluster: Cluster, layout: Layout) -> dict[str, float]:
    """GB/s per GPU of the link each axis's traffic crosses: NVLink while its group stays inside a node (TP: while its
    size divides a node's GPUs); else the network, which a ring shares out over the group's GPUs in a node: each
    GPU's NIC carries one crossing of the ring's channels, so a ring with ``g`` members per node moves ``g`` NICs'
    worth per GPU (NVLink bounding it), and one with a member per node its NIC's. DiLoCo's islands: the link between
    them."""
    tp, cp, dp, per_node = layout.tp, layout.cp, layout.dp, cluster.gpus_per_node
    spans = {"tp": tp, "cp": tp * cp, "dp": tp * cp * dp, "pp": layout.island_size, "ep": tp * cp * layout.ep}
    inner = {"tp": 1, "cp": tp, "dp": tp * cp, "pp": per_node, "ep": tp * cp}  # ranks between two of the group's
    if layout.dp_replicate > 1:  # HSDP: a shard group of consecutive replicas, and the groups' replicas of each rank
        spans.update(dp_shard=tp * layout.shard_ranks, dp_replicate=tp * cp * dp)
        inner.update(dp_shard=tp, dp_replicate=tp * layout.shard_ranks)
    links = {}
    for axis, span in spans.items():
        members = max(1, per_node // inner[axis]) if axis.startswith(("dp", "cp")) else 1  # rings; EP, PP: p2p
        network = min(cluster.intra_node_gbps, cluster.inter_node_gbps * members)
        links[axis] = cluster.intra_node_gbps if span <= per_node else network
    links["tp"] = cluster.intra_node_gbps if per_node % tp == 0 else cluster.inter_node_gbps
    if layout.islands > 1:  # DiLoCo's outer step crosses the link between islands
        links["island"] = cluster.inter_island_gbps
    return links


def latencies(cluster: Cluster, links: dict[str, float], counts: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Seconds of latency per axis and step: NCCL's base latency per collective and its latency per ring hop on the
    axis's link (`traffic.collectives` counts both)."""
    latency = {}
    for axis, (n, hops) in counts.items():
        if axis == "island":
            latency[axis] = n * cluster.collective_latency_us * 1e-6 + hops * cluster.inter_island_latency_ms * 1e-3
            continue
        hop = cluster.intra_node_hop_us if links[axis] == cluster.intra_node_gbps else cluster.inter_node_hop_us
        latency[axis] = (n * cluster.collective_latency_us + hops * hop) * 1e-6
    return latency
