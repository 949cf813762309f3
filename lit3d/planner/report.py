"""Text reports of the planner: one layout in detail, or the best layouts of a search."""

from __future__ import annotations

from lit3d.config import GPTConfig
from lit3d.parallel.layout import Layout
from lit3d.planner.estimate import GB, Cluster, Plan, Training
from lit3d.planner.pipeline import label, same_schedule, schedule_flags, why_schedule
from lit3d.planner.search import Candidate, tokens_per_second, why


def count(n: float) -> str:
    """``1.2B``, ``850.0M``, ``12.3K``: a count in the unit its size calls for."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def size(n_bytes: float) -> str:
    """``69.8 GB``, ``12.50 MB``, ``4.1 kB``: bytes in the unit their size calls for (powers of 1000, as ``GB``)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes:.0f} B"


def plural(word: str) -> str:
    return word + ("es" if word.endswith("s") else "s")


def describe(config: GPTConfig, cluster: Cluster) -> str:
    return (
        f"{config.name} ({count(config.num_params)} parameters) on {cluster.nodes} node(s) x "
        f"{cluster.gpus_per_node} {plural(cluster.device)} "
        f"({cluster.gpu_memory_gb:g} GB, {cluster.peak_tflops:g} TFLOP/s; "
        f"links {cluster.intra_node_gbps:g} GB/s in a node, {cluster.inter_node_gbps:g} GB/s between nodes)"
    )


def settings(layout: Layout, training: Training, plan: Plan) -> str:
    cp = f" x cp {layout.cp}" if layout.cp > 1 else ""
    grid = f"dp {layout.dp}{cp} x tp {layout.tp} x pp {layout.pp}"
    grid = f"{layout.islands} islands x ({grid})" if layout.islands > 1 else grid
    parts = [grid, f"ZeRO-{training.zero_stage}", training.precision]
    if training.activation_checkpointing:
        selective = training.activation_checkpointing == "selective"
        parts.append("selective activation checkpointing" if selective else "activation checkpointing")
    if training.sequence_parallel and layout.tp > 1:
        parts.append("sequence parallel")
    if layout.pp > 1:
        parts.append(
            training.pipeline_schedule
            + (f" v{training.virtual_pipeline_size}" if training.virtual_pipeline_size > 1 else "")
        )
    parts.append(
        f"{plan.num_microbatches} micro-batch(es) of {training.micro_batch_size} x {training.seq_len} tokens "
        "per replica"
    )
    return ", ".join(parts)


def format_plan(config: GPTConfig, cluster: Cluster, layout: Layout, training: Training, plan: Plan) -> str:
    usable = cluster.gpu_memory_gb * (1 - training.headroom)
    stage = plan.memory_by_stage.index(plan.memory_per_gpu)
    lines = [
        f"lit3d plan: {describe(config, cluster)}",
        f"layout: {settings(layout, training, plan)}",
        f"memory per {cluster.device}, most loaded rank (pipeline stage {stage}):",
    ]
    for key, value in plan.memory_per_gpu.items():  # NOTE: the total is the step's peak, less than the sum
        lines.append(f"  {'peak' if key == 'total' else key:<12}{size(value):>12}")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines[-1] += (
        f"   of {usable:.1f} usable ({cluster.gpu_memory_gb:g} GB less {training.headroom:.0%} headroom): {verdict}"
    )
    lines.append(f"communication per step, per {cluster.device}:")
    for axis, comm in plan.communication_per_step.items():
        lines.append(f"  {axis:<4}{size(comm['bytes']):>12}  {comm['seconds']:>8.3f} s  on {comm['link_gbps']:g} GB/s")
    if layout.pp > 1:
        lines.append(
            f"pipeline bubble: {plan.pipeline_bubble:.1%} ({training.pipeline_schedule}, p={layout.pp}, "
            f"m={plan.num_microbatches})"
        )
        if plan.schedule_candidates:
            lines += format_candidates(plan)
    lines.append(
        f"step time: {plan.step_time_s:.3f} s, {tokens_per_second(plan, training):,.0f} tokens/s, "
        f"MFU {plan.mfu:.1%} (matmuls assumed at {training.efficiency:.0%} of peak)"
    )
    return "\n".join(lines)


def format_candidates(plan: Plan) -> list[str]:
    """The report's lines on the schedules weighed for one layout, the chosen one first."""
    lines = [f"pipeline schedules weighed ({why_schedule(plan)}):"]
    lines.append(f"  {'schedule':<22}{'m':>5}{'bubble':>9}{'step s':>10}{'activations':>14}  fits")
    order = lambda c: (not same_schedule(c, plan), not c["fits"], c["step_time_s"])  # the chosen one first
    ranked = sorted(plan.schedule_candidates, key=order)
    for c in ranked:
        lines.append(
            f"  {label(c['pipeline_schedule'], c['virtual_pipeline_size']):<22}{c['num_microbatches']:>5}"
            f"{c['bubble']:>9.1%}{c['step_time_s']:>10.3f}{size(c['activations_bytes']):>14}  "
            + ("yes" if c["fits"] else "no")
            + ("  <- chosen" if same_schedule(c, plan) else "")
        )
    return lines


def _schedule(candidate: Candidate) -> str:
    training = candidate.training
    return label(training.pipeline_schedule, training.virtual_pipeline_size) if candidate.layout.pp > 1 else "-"


def format_search(
    config: GPTConfig, cluster: Cluster, candidates: list[Candidate], dropped: dict[str, int], top: int
) -> str:
    lines = [
        f"lit3d plan: {describe(config, cluster)}",
        f"{len(candidates)} layout(s) fit; dropped {dropped['invalid']} invalid and "
        f"{dropped['out_of_memory']} that do not fit in memory",
    ]
    if not candidates:
        lines.append(
            "nothing fits: add GPUs, use a longer pipeline or more tensor parallelism, "
            "lower micro_batch_size or seq_len"
        )
        return "\n".join(lines)
    if candidates[0].layout.islands > 1:
        lines.append(f"each of {candidates[0].layout.islands} islands runs the layout (dp: replicas per island)")
    lines.append(
        f"{'#':>2}  {'dp':>5} {'cp':>3} {'tp':>3} {'pp':>3} {'ep':>3} {'zero':>4} {'ac':>3} {'m':>4} {'schedule':>16} "
        f"{'memory GB':>9} {'step s':>8} {'MFU':>6}"
    )
    for i, c in enumerate(candidates[:top], 1):
        lines.append(
            f"{i:>2}  {c.layout.dp:>5} {c.layout.cp:>3} {c.layout.tp:>3} {c.layout.pp:>3} {c.layout.ep:>3} "
            f"{c.training.zero_stage:>4} "
            f"{'yes' if c.training.activation_checkpointing else 'no':>3} {c.plan.num_microbatches:>4} "
            f"{_schedule(c):>16} {c.plan.memory_per_gpu['total'] / GB:>9.1f} {c.plan.step_time_s:>8.3f} "
            f"{c.plan.mfu:>6.1%}"
        )
        lines.append(f"    why: {why(c, cluster)}")
    best = candidates[0]
    flags = (
        f"--trainer.strategy.tensor_parallel_size={best.layout.tp} "
        f"--trainer.strategy.pipeline_parallel_size={best.layout.pp} "
        f"--trainer.strategy.zero_stage={best.training.zero_stage}"
    )
    if best.layout.ep > 1:
        flags += f" --trainer.strategy.expert_parallel_size={best.layout.ep}"
    if best.layout.cp > 1:
        flags += f" --trainer.strategy.context_parallel_size={best.layout.cp}"
    if best.training.activation_checkpointing:
        flags += " --trainer.strategy.activation_checkpointing=true"
    if best.layout.pp > 1:
        flags += schedule_flags(best.training, best.plan)
    if best.layout.islands > 1:
        islands, h = best.layout.islands, best.training.sync_every
        flags += f" --trainer.strategy.islands={islands} --trainer.strategy.sync_every={h}"
    lines.append(f"run the best with: lit3d fit ... --trainer.strategy=Parallel3DStrategy {flags}")
    return "\n".join(lines)


def format_verify(layout: Layout, counts: list) -> str:
    """The report's lines on `lit3d.planner.verify`'s per-stage parameter counts against the analytic ones."""
    lines = [
        f"verify: the real parallelisation on {layout.world_size} simulated ranks (meta device, fake process group), "
        "parameters on rank (d=0, t=0, p):"
    ]
    for c in counts:
        lines.append(
            f"  stage {c.stage:>3} rank {c.rank:>6}: {c.verified:>14,} verified  {c.analytic:>14,} analytic"
            f"  {'match' if c.matches else 'MISMATCH'}"
        )
    return "\n".join(lines)
