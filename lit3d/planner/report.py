"""Text reports of the planner: one layout in detail, or the best layouts of a search."""

from __future__ import annotations

from dataclasses import fields

from lit3d.models.config import GPTConfig
from lit3d.parallel.layout import Layout
from lit3d.parallel.settings import Parallelism, defaults
from lit3d.planner.clock import largest_costs
from lit3d.planner.estimate import GB, Cluster, Plan
from lit3d.planner.hsdp import GROUPS_PAY, one_group_run, unpaid_groups
from lit3d.planner.pipeline import label, same_schedule, schedule_flags, why_schedule
from lit3d.planner.search import Candidate, tokens_per_second, why
from lit3d.planner.units import plural, size


def count(n: float) -> str:
    """``1.2B``, ``850.0M``, ``12.3K``: a count in the unit its size calls for."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def describe(config: GPTConfig, cluster: Cluster) -> str:
    return (
        f"{config.name} ({count(config.num_params)} parameters) on {cluster.nodes} node(s) x "
        f"{cluster.gpus_per_node} {plural(cluster.device)} "
        f"({cluster.gpu_memory_gb:g} GB, {cluster.peak_tflops:g} TFLOP/s; "
        f"links {cluster.intra_node_gbps:g} GB/s in a node, {cluster.inter_node_gbps:g} GB/s between nodes)"
    )


def settings(candidate: Candidate) -> str:
    """The layout line of a report: the grid and the settings that change what it holds and sends."""
    layout, training, run, plan = candidate.layout, candidate.training, candidate.parallelism, candidate.plan
    parts = [
        layout.grid,
        f"ZeRO-{run.zero_stage}" + (" offloaded to the host" if run.offload else ""),
        training.precision,
    ]
    if training.lora is not None:
        parts.append(f"LoRA rank {training.lora.rank} on {', '.join(training.lora.targets)}, the rest frozen")
    if run.mixed_precision_reduce != "float32" and training.precision == "bf16-mixed":
        parts.append(f"gradients reduced in {run.mixed_precision_reduce}")
    if run.activation_checkpointing:
        selective = run.activation_checkpointing == "selective"
        parts.append("selective activation checkpointing" if selective else "activation checkpointing")
    if run.splits_sequence(layout):
        parts.append("sequence parallel")
    if layout.pp > 1:
        parts.append(run.pipeline_schedule + (f" v{run.chunks_per_rank}" if run.chunks_per_rank > 1 else ""))
    parts.append(
        f"{plan.num_microbatches} micro-batch(es) of {training.micro_batch_size} x {training.seq_len} tokens "
        "per replica"
    )
    return ", ".join(parts)


def format_plan(config: GPTConfig, cluster: Cluster, candidate: Candidate) -> str:
    """One layout in detail: memory per kind, traffic per axis, the pipeline's bubble and schedules, the step."""
    layout, training, plan = candidate.layout, candidate.training, candidate.plan
    usable = cluster.gpu_memory_gb * (1 - training.headroom)
    stage = plan.memory_by_stage.index(plan.memory_per_gpu)
    lines = [
        f"lit3d plan: {describe(config, cluster)}",
        f"layout: {settings(candidate)}",
        f"memory per {cluster.device}, most loaded rank (pipeline stage {stage}):",
    ]
    for key, value in plan.memory_per_gpu.items():  # NOTE: the total is the step's peak, less than the sum
        name = {"total": "peak", "host": "host memory"}.get(key, key)
        lines.append(f"  {name:<12}{size(value):>12}")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines[-1] += (
        f"   of {usable:.1f} usable ({cluster.gpu_memory_gb:g} GB less {training.headroom:.0%} headroom): {verdict}"
    )
    lines.append(f"communication per step, per {cluster.device}:")
    width = max(len(axis) for axis in plan.communication_per_step)  # (HSDP's dp_replicate)
    for axis, comm in plan.communication_per_step.items():
        lines.append(
            f"  {axis:<{width}}{size(comm['bytes']):>12}  {comm['seconds']:>8.3f} s  on {comm['link_gbps']:g} GB/s"
        )
    if layout.pp > 1:
        lines.append(
            f"pipeline bubble: {plan.pipeline_bubble:.1%} ({candidate.parallelism.pipeline_schedule}, p={layout.pp}, "
            f"m={plan.num_microbatches})"
        )
        if plan.schedule_candidates:
            lines += format_candidates(plan)
    lines.append(
        f"step time: {plan.step_time_s:.3f} s, {tokens_per_second(plan, training):,.0f} tokens/s "
        f"({plan.tokens_per_s_per_gpu:,.0f} per {cluster.device}), MFU {plan.mfu:.1%}"
    )
    lines.append(f"  spent on: {largest_costs(plan.time_breakdown, plan.step_time_s, top=6)}")
    lines += replica_group_lines(candidate, cluster)
    return "\n".join(lines)


def replica_group_lines(candidate: Candidate, cluster: Cluster) -> list[str]:
    """With ``replica_groups``: the groups, each the layout launched apart, and what a group that rejoins loads."""
    groups = candidate.parallelism.replica_groups or 1
    if groups == 1:
        return []
    every = candidate.parallelism.sync_every
    averaging = (
        "averaging gradients each step"
        if every == 1
        else f"each a DiLoCo island, averaging pseudo-gradients every {every} steps"
    )
    return [
        f"replica groups: {groups}, each this layout launched apart (REPLICA_GROUP_ID 0-{groups - 1}), "
        f"{averaging} (`replica` bytes); a group that rejoins loads {size(candidate.plan.rejoin_bytes())} a "
        f"{cluster.device} from a live one (weights and optimizer state), once"
    ]


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
    run = candidate.parallelism
    return label(run.pipeline_schedule, run.chunks_per_rank) if candidate.layout.pp > 1 else "-"


def format_search(
    config: GPTConfig,
    cluster: Cluster,
    candidates: list[Candidate],
    dropped: dict[str, int],
    top: int,
    given: frozenset[str] = frozenset(),
    command: str | None = None,
    nearest_miss: Candidate | None = None,
) -> str:
    """The best ``top`` layouts of a search, each with why, and the command that runs the best (``command``: the whole
    ``lit3d fit`` command, `lit3d.planner.launch.fit_command`; else its strategy flags, with the settings ``given``);
    if none fits, the layout that needs the least memory (``nearest_miss``) and what it lacks."""
    lines = [
        f"lit3d plan: {describe(config, cluster)}",
        f"{len(candidates)} layout(s) fit; dropped {dropped['invalid']} invalid and "
        f"{dropped['out_of_memory']} that do not fit in memory",
    ]
    if not candidates:
        if nearest_miss is not None:
            lines += format_miss(cluster, nearest_miss)
        lines.append(
            "nothing fits: add GPUs, use a longer pipeline or more tensor parallelism, "
            "lower micro_batch_size or seq_len"
        )
        return "\n".join(lines)
    if candidates[0].layout.islands > 1:
        lines.append(f"each of {candidates[0].layout.islands} islands runs the layout (dp: replicas per island)")
    lines += replica_group_lines(candidates[0], cluster)
    lines.append(
        f"{'#':>2}  {'dp':>7} {'cp':>3} {'tp':>3} {'pp':>3} {'ep':>3} {'zero':>4} {'ac':>3} {'m':>4} {'schedule':>16} "
        f"{'memory GB':>9} {'step s':>8} {'MFU':>6}"
    )
    unpaid = unpaid_groups(candidates)  # (`hsdp_lines` says why they are not shown)
    for i, c in enumerate([c for c in candidates if id(c) not in unpaid][:top], 1):
        lines.append(
            f"{i:>2}  {_replicas(c.layout):>7} {c.layout.cp:>3} {c.layout.tp:>3} {c.layout.pp:>3} {c.layout.ep:>3} "
            f"{c.parallelism.zero_stage:>4} "
            f"{'yes' if c.parallelism.activation_checkpointing else 'no':>3} {c.plan.num_microbatches:>4} "
            f"{_schedule(c):>16} {c.plan.memory_per_gpu['total'] / GB:>9.1f} {c.plan.step_time_s:>8.3f} "
            f"{c.plan.mfu:>6.1%}"
        )
        lines.append(f"    why: {why(c, cluster)}")
    lines += hsdp_lines(candidates)
    command = command or f"lit3d fit ... --trainer.strategy=Parallel3DStrategy {run_flags(candidates[0], given)}"
    lines.append(f"run the best with: {command}")
    return "\n".join(lines)


def _replicas(layout: Layout) -> str:
    """The table's ``dp``: the replicas, or with HSDP's shard groups ``groups x shard``."""
    return f"{layout.dp_replicate}x{layout.shard_size}" if layout.dp_replicate > 1 else str(layout.dp)


def hsdp_lines(candidates: list[Candidate]) -> list[str]:
    """Whether HSDP's shard groups pay here, and why: the fastest layout with groups against the same run over one
    group of every replica, their step times, where each sends its data-parallel bytes, and their memory."""
    grouped = next((c for c in candidates if c.layout.dp_shard is not None), None)
    if grouped is None:
        return []
    layout, run = grouped.layout, grouped.parallelism
    same = one_group_run(grouped)
    whole = next((c for c in candidates if c.layout.dp_shard is None and one_group_run(c) == same), None)
    if whole is None:
        return []
    comm, plain = grouped.plan.communication_per_step, whole.plan.communication_per_step["dp"]
    shard, across = comm["dp_shard"], comm["dp_replicate"]
    wins = candidates.index(grouped) < candidates.index(whole)  # (the search ranks groups first where they pay)
    gain = 1 - grouped.plan.step_time_s / whole.plan.step_time_s
    nodes = -(-layout.shard_size * layout.tp * layout.cp // layout.devices_per_node)
    return [
        f"HSDP {'wins' if wins else 'does not pay'} here: ZeRO-{run.zero_stage} in {layout.dp_replicate} shard groups "
        f"of {layout.shard_size} takes {grouped.plan.step_time_s:.3f} s/step, {abs(gain):.1%} "
        f"{'less' if gain >= 0 else 'more'} than "
        f"{whole.plan.step_time_s:.3f} s over one group of {layout.replicas} ({settings(whole)}); groups are chosen "
        f"where they save {GROUPS_PAY:.0%} or more",
        f"    why: a group spans {nodes} node{'s' if nodes > 1 else ''}: its gathers and reduce-scatters move "
        f"{size(shard['bytes'])} in {shard['seconds']:.2f} s on {shard['link_gbps']:g} GB/s and the all-reduce across "
        f"groups {size(across['bytes'])} in {across['seconds']:.2f} s on {across['link_gbps']:g} GB/s, against "
        f"{size(plain['bytes'])} in {plain['seconds']:.2f} s on {plain['link_gbps']:g} GB/s over one group; a GPU "
        f"holds {size(grouped.plan.memory_per_gpu['total'])} against {size(whole.plan.memory_per_gpu['total'])}",
    ]


def format_miss(cluster: Cluster, candidate: Candidate) -> list[str]:
    """The report's lines on the layout that needs the least memory when none fits: its settings, and by how much."""
    usable = cluster.gpu_memory_gb * (1 - candidate.training.headroom)
    needed = candidate.plan.memory_per_gpu["total"] / GB
    return [
        f"nearest miss: {settings(candidate)}",
        f"  needs {needed:.1f} GB per {cluster.device} of {usable:.1f} usable: {needed - usable:.1f} GB short",
    ]


# Settings `run_flags` writes whatever their value (the search chose them), in this order, and those it leaves out:
# the sizes it writes as they are planned, the micro-batches with the schedule.
CHOSEN = ("tensor_parallel_size", "pipeline_parallel_size", "zero_stage")
UNWRITTEN = ("data_parallel_size", "num_microbatches", "virtual_pipeline_size", "pipeline_schedule", "sync_every")


def run_flags(candidate: Candidate, given: frozenset[str] = frozenset()) -> str:
    """The strategy's flags that run ``candidate`` as planned: its sizes and ZeRO stage, what else it chose (recompute,
    the schedule, DiLoCo's islands), and the settings ``given`` that differ from the strategy's defaults."""
    layout, run = candidate.layout, candidate.parallelism
    flags = [f"--trainer.strategy.{name}={getattr(run, name)}" for name in CHOSEN]
    written = {*CHOSEN, *UNWRITTEN, "islands", "activation_checkpointing", "data_parallel_shard_size"}
    if layout.dp_shard:
        flags.append(f"--trainer.strategy.data_parallel_shard_size={layout.dp_shard}")
    for name, ranks in (("expert_parallel_size", layout.ep), ("context_parallel_size", layout.cp)):
        written.add(name)
        if ranks > 1:
            flags.append(f"--trainer.strategy.{name}={ranks}")
    if run.activation_checkpointing:
        flags.append(f"--trainer.strategy.activation_checkpointing={_flag(run.activation_checkpointing)}")
    text = " ".join(flags)
    if layout.pp > 1:
        text += schedule_flags(candidate.training, run, candidate.plan)
    if layout.islands > 1:
        text += f" --trainer.strategy.islands={layout.islands} --trainer.strategy.sync_every={run.sync_every}"
    elif run.sync_every > 1:  # (DiLoCo over one island, or over the replica groups)
        text += f" --trainer.strategy.sync_every={run.sync_every}"
    if run.splits_sequence(layout):  # planned with it (`PLANNING_DEFAULTS`), which the strategy leaves off unless told
        text += " --trainer.strategy.sequence_parallel=true"
    if run.accumulate_unsharded:  # the search's choice where memory allows
        text += " --trainer.strategy.accumulate_unsharded=true"
    written.update(("sequence_parallel", "accumulate_unsharded"))
    default = defaults()
    for f in fields(Parallelism):
        if f.name in given and f.name not in written and getattr(run, f.name) != default.get(f.name):
            text += f" --trainer.strategy.{f.name}={_flag(getattr(run, f.name))}"
    lora = candidate.training.lora
    if lora is not None:
        text += f" --model.lora.rank={lora.rank} --model.lora.targets=[{','.join(lora.targets)}]"
    return text


def _flag(value: object) -> str:
    """A value as the command line takes it (``true``, ``selective``, ``bfloat16``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def format_verify(layout: Layout, counts: list) -> str:
    """The report's lines on `lit3d.planner.verify`'s per-stage parameter counts against the analytic ones."""
    lines = [
        f"verify: the real parallelisation on {layout.world_size} simulated ranks (meta device, fake process group), "
        "parameters on rank (p, d=0, t=0):"
    ]
    for c in counts:
        lines.append(
            f"  stage {c.stage:>3} rank {c.rank:>6}: {c.verified:>14,} verified  {c.analytic:>14,} analytic"
            f"  {'match' if c.matches else 'MISMATCH'}"
        )
    return "\n".join(lines)
