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

from dataclasses import dataclass
from functools import cached_property

from lit3d.models.config import GPTConfig
from lit3d.parallel.layout import Layout
from lit3d.parallel.settings import Parallelism
from lit3d.planner.clock import RankWork, StepTime, micro_batch_times, step_time
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
    Held,
    Memory,
    activation_bytes_per_token,
    autocast_weight_bytes,
    held_by_stage,
    memory_by_stage,
    output_layer_bytes,
)
from lit3d.planner.muon import newton_schulz_work, orthogonal_traffic
from lit3d.planner.sums import StageSums, rank_sums
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
    ranks = Ranks(case, case.chunks)
    return price(case, ranks, memory_by_stage(case, ranks.held))


@dataclass(frozen=True, eq=False)
class Ranks:
    """What the pipeline ranks of ``case`` hold and compute whatever its micro-batches, with ``chunks`` per rank placed
    as given (`Case.chunks`; which blocks each rank holds), each part worked out when first asked: once for every
    schedule of those chunks and every micro-batch count the planner weighs (`lit3d.planner.pipeline`), and only the
    memory for a layout that does not fit."""

    case: Case
    chunks: tuple[int, str]

    @cached_property
    def held(self) -> Held:
        """Weights, gradients, optimizer states, buffers (`lit3d.planner.memory`)."""
        return held_by_stage(self.case, self.chunks)

    @cached_property
    def sums(self) -> tuple[StageSums, ...]:
        """What each rank holds, summed (`lit3d.planner.sums`), each distinct one once."""
        return tuple(dict.fromkeys(rank_sums(self.case, True, self.chunks)))

    @cached_property
    def bare(self) -> tuple[StageSums, ...]:
        """`sums` of the model without its adapters (the collectives count those)."""
        if self.case.training.lora is None:
            return self.sums
        return tuple(dict.fromkeys(rank_sums(self.case, False, self.chunks)))

    @cached_property
    def links(self) -> dict[str, float]:
        """GB/s per GPU of the link each axis's traffic crosses (`link_speeds`)."""
        return link_speeds(self.case.cluster, self.case.layout)

    @cached_property
    def params(self) -> tuple[int, int]:
        """The model's parameters, and those one token uses (`GPTConfig.num_params`, `GPTConfig.active_params`)."""
        return self.case.config.num_params, self.case.config.active_params

    @cached_property
    def work(self) -> RankWork:
        """One micro-batch's times and the optimizer's step on each rank (`lit3d.planner.clock`)."""
        sums = rank_sums(self.case, True, self.chunks)
        stepped = tuple(rank.stepped for rank in self.held.ranks)
        newton_schulz = tuple(newton_schulz_work(self.case, s) for s in sums)
        return RankWork(micro_batch_times(self.case, sums), stepped, newton_schulz)


def timed(case: Case, ranks: Ranks) -> tuple[StepTime, dict[str, float], dict[str, float], dict[str, float]]:
    """The step of ``case`` (`step_time`), the bytes each axis sends, their latency and their seconds, from what its
    ranks hold and compute whatever its micro-batches (``ranks``: `Ranks` of it, or of it at another micro-batch
    count)."""
    cluster = case.cluster
    traffic, links = communication_bytes(case, ranks.sums), ranks.links
    latency = latencies(cluster, links, collectives(case, ranks.bare))
    reached = cluster.gpu.efficiency.link  # of a link's rated bandwidth, by ring collectives
    seconds = {axis: traffic[axis] / (links[axis] * reached * GB) + latency[axis] for axis in traffic}
    muon = {axis: sent / (links[axis] * reached * GB) for axis, sent in orthogonal_traffic(case, ranks.sums).items()}
    exposed = {axis: value - muon.get(axis, 0.0) for axis, value in seconds.items()}  # (Muon's: the optimizer's step)
    time = step_time(case, traffic, exposed, ranks.work, sum(muon.values()))
    return time, traffic, latency, time.seconds or seconds  # (a fleet's TP: each stage's bytes over its NVLink)


def price(case: Case, ranks: Ranks, memory: Memory, timing: tuple | None = None) -> Plan:
    """The `Plan` of ``case``, from what its ranks hold and compute whatever its micro-batches (``ranks``: as `timed`),
    its ``memory`` (`memory_by_stage`) and its ``timing`` (`timed`, if worked out already)."""
    layout, training, settings, links = case.layout, case.training, case.settings, ranks.links
    time, traffic, latency, seconds = timing or timed(case, ranks)
    cluster = case.cluster
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
        fits=fits(memory.by_stage, cluster, training),
        num_microbatches=time.microbatches,
        flops_per_step=float(time.model_flops),
        params_total=ranks.params[0],
        params_per_rank=memory.params_per_rank,
        params_active=ranks.params[1],
        activation_bytes_per_layer=memory.activation_bytes_per_layer,
        pipeline_schedule=settings.pipeline_schedule if layout.pp > 1 else None,
    )


def fits(by_stage: list[dict[str, int]], cluster: Cluster, training: Training) -> bool:
    """Whether every pipeline rank's peak (``by_stage``: `Memory.by_stage`) fits its GPU's memory,
    ``training.headroom`` kept free."""
    return _within([stage["total"] for stage in by_stage], cluster, training)


def may_fit(held: Held, cluster: Cluster, training: Training) -> bool:
    """Whether ``held`` may fit with some number of micro-batches in flight: no rank's least peak (`Held.floors`)
    passes its GPU's memory (as `fits` counts it)."""
    return _within(held.floors, cluster, training)


def _within(totals: list[int], cluster: Cluster, training: Training) -> bool:
    if cluster.stage_gpus is None:  # (every rank on the same GPU)
        usable = cluster.gpu_memory_gb * GB * (1 - training.headroom)
        return all(total <= usable for total in totals)
    return all(
        total <= cluster.stage(rank).gpu_memory_gb * GB * (1 - training.headroom) for rank, total in enumerate(totals)
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
    links["replica"] = cluster.inter_node_gbps  # replica groups are jobs of their own: each rank's ring leaves its node
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
