"""A fleet's plan (`plan_fleet`): the ways to run it (`lit3d.planner.fleet`), the chosen one with each group's part,
the two baselines, and what ``lit3d plan --fleet`` prints (text, ``--json``, the rank map coloured by GPU kind)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit3d.models.config import GPTConfig
from lit3d.planner.estimate import Cluster
from lit3d.planner.fleet import (
    CHOSEN_BY_FLEET,
    ONE_CHUNK,
    Option,
    baseline,
    check_fleet,
    data_option,
    fastest_group,
    islands_option,
    pipeline_option,
    shared_cluster,
)
from lit3d.planner.rankmap import RankMap
from lit3d.planner.report import count, run_flags, settings
from lit3d.planner.request import Request, check_inputs

KINDS = {
    "pipeline": "uneven pipeline stages",
    "data": "uneven data-parallel shares",
    "islands": "one DiLoCo island per group",
}


@dataclass
class FleetReport:
    """What a fleet plan found: ``options`` (pipeline, data, islands), ``baselines`` (the fastest group alone, every
    GPU as the slowest kind) and the request they were planned for."""

    config: GPTConfig
    groups: list[Cluster]
    request: Request
    options: list[Option]
    baselines: list[Option]

    @property
    def chosen(self) -> Option | None:
        """The fastest option that fits (None if none does)."""
        fitting = [o for o in self.options if o.candidate and o.candidate.plan.fits]
        return min(fitting, key=lambda o: o.step_time_s) if fitting else None

    def flags(self) -> str:
        """``lit3d fit``'s flags that run the chosen option: the nodes, the strategy, the uneven work."""
        chosen = self.chosen
        if chosen is None:
            return ""
        run, training = chosen.candidate.parallelism, chosen.candidate.training
        text = (
            f"--trainer.num_nodes={sum(g.nodes for g in self.groups)} --trainer.devices="
            f"{self.groups[0].gpus_per_node} --trainer.strategy=Parallel3DStrategy "
            f"{run_flags(chosen.candidate, self.request.fixed)}"
        )
        if run.pipeline_stage_layers:
            text += f" --trainer.strategy.pipeline_stage_layers=[{','.join(map(str, run.pipeline_stage_layers))}]"
        if run.data_parallel_shares:
            text += f" --trainer.strategy.data_parallel_shares=[{','.join(map(str, run.data_parallel_shares))}]"
            if training.accumulate_grad_batches > 1:
                text += f" --trainer.accumulate_grad_batches={training.accumulate_grad_batches}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """``lit3d plan --fleet ... --json``: the chosen option with each group's assignment, the others, the
        baselines and the flags that run it."""
        chosen = self.chosen
        return {
            "model": self.config.name,
            "fleet": [{"nodes": g.nodes, "gpus_per_node": g.gpus_per_node, "gpu": g.gpu.name} for g in self.groups],
            "chosen": _option_dict(chosen) if chosen else None,
            "options": [_option_dict(o) for o in self.options],
            "baselines": [_option_dict(o) for o in self.baselines],
            "flags": self.flags(),
        }

    def rank_map(self) -> RankMap:
        """The chosen layout's rank map, each rank coloured by its node's GPU kind."""
        chosen = self.chosen
        if chosen is None:
            raise ValueError("nothing fits the fleet: no rank map to draw")
        kinds = [g.gpu.name for g in self.groups for _ in range(g.nodes)]
        title = f"{self.config.name} on {fleet_name(self.groups)}: {KINDS[chosen.kind]}"
        return RankMap(chosen.candidate.layout, title, chosen.candidate.plan, kinds=kinds)


def plan_fleet(groups: list[Cluster], model: GPTConfig | str = "llama-8b", **given: Any) -> FleetReport:
    """Plan ``model`` on a fleet of node groups (``groups``, in the order of the job's node ranks): every way to use
    it that `lit3d.planner.fleet` prices, and the two baselines. ``given``: as `Request.given` (the training loop's
    numbers, the settings to keep); the fleet chooses its sizes and uneven work itself."""
    check_fleet(groups)
    chosen_here = sorted(name for name in CHOSEN_BY_FLEET if name in given)
    if chosen_here:
        raise ValueError(f"{', '.join(chosen_here)}: a fleet plan chooses these itself; plan without them")
    tp, schedule = given.get("tensor_parallel_size"), given.get("pipeline_schedule")
    if tp is not None and tp != "auto" and groups[0].gpus_per_node % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the {groups[0].gpus_per_node} GPUs of a node: "
            "on a fleet TP stays inside a node"
        )
    if schedule is not None and schedule not in {name for name, _ in ONE_CHUNK}:
        raise ValueError(
            f"pipeline_schedule={schedule!r}: uneven stages are planned with one chunk per rank "
            f"({', '.join(name for name, _ in ONE_CHUNK)})"
        )
    request = Request.given(model, shared_cluster(groups), **given)
    config = GPTConfig.load(model)
    without = sorted({g.gpu.name for g in groups if not g.gpu.fp8_tflops})
    if request.parallelism.float8 and without:
        raise ValueError(
            f"float8={request.parallelism.float8!r} on a fleet with {', '.join(without)}: no FP8 tensor cores there"
        )
    for group in groups:
        check_inputs(config, group, request.training)
    options = [build(config, groups, request) for build in (pipeline_option, data_option, islands_option)]
    # (the request's cluster: every GPU as the slowest kind)
    baselines = [
        baseline(fastest_group(groups), request, "fastest group"),
        baseline(request.cluster, request, "slowest kind"),
    ]
    return FleetReport(config, groups, request, options, baselines)


def fleet_name(groups: list[Cluster]) -> str:
    """``2 x 8 H100 + 6 x 8 A100``."""
    return " + ".join(f"{g.nodes} x {g.gpus_per_node} {g.gpu.name}" for g in groups)


def _option_dict(option: Option) -> dict[str, Any]:
    entry: dict[str, Any] = {"kind": option.kind, "note": option.note or None, "groups": option.parts}
    if option.candidate:
        plan, run = option.candidate.plan, option.candidate.parallelism
        entry.update(
            layout=plan.layout,
            step_time_s=plan.step_time_s,
            mfu=plan.mfu,
            fits=plan.fits,
            memory_gb=plan.memory_per_gpu["total"] / 1e9,
            num_microbatches=plan.num_microbatches,
            pipeline_schedule=plan.pipeline_schedule,
            pipeline_stage_layers=run.pipeline_stage_layers,
            data_parallel_shares=run.data_parallel_shares,
            activation_checkpointing=run.activation_checkpointing,
        )
    return entry


def format_fleet(report: FleetReport) -> str:
    """What ``lit3d plan --fleet`` prints: the chosen option, each group's part, why, the others and the baselines."""
    groups, config, training = report.groups, report.config, report.request.training
    lines = [
        f"lit3d plan: {config.name} ({count(config.num_params)} parameters) on a fleet of {fleet_name(groups)} "
        f"({sum(g.gpus for g in groups)} GPUs); global batch {training.global_batch_size} x {training.seq_len} "
        "tokens"
    ]
    chosen = report.chosen
    if chosen is None:
        lines.append("nothing fits the fleet: add GPUs, lower micro_batch_size or seq_len")
    else:
        c = chosen.candidate
        lines += [
            f"chosen: {KINDS[chosen.kind]}: {settings(c)}",
            *(_part_line(p) for p in chosen.parts),
            f"  step {c.plan.step_time_s:.1f} s, MFU {c.plan.mfu:.1%} of the fleet's peak",
            f"why: {_why(chosen)}",
        ]
    lines.append("options:")
    for option in report.options:
        lines.append(f"  {KINDS[option.kind]:<32} {_outcome(option, chosen)}")
    lines.append("baselines:")
    fastest, slowest = fastest_group(groups), report.request.cluster
    names = {
        "fastest group": f"the fastest group alone ({fastest.nodes} x {fastest.gpus_per_node} {fastest.gpu.name})",
        "slowest kind": f"every GPU as the slowest kind ({slowest.gpus} {slowest.gpu.name})",
    }
    for option in report.baselines:
        lines.append(f"  {names[option.kind]}: {_outcome(option, chosen)}")
    if chosen:
        lines.append(f"run it with: lit3d fit ... {report.flags()}")
        starts = [sum(g.nodes for g in groups[:i]) for i in range(len(groups))]
        order = ", ".join(f"{s}-{s + g.nodes - 1} {g.gpu.name}" for s, g in zip(starts, groups))
        lines.append(f"  node ranks in the fleet's order: {order}")
    return "\n".join(lines)


def _part_line(part: dict[str, Any]) -> str:
    work = part.get("pipeline_stage_layers") or part.get("data_parallel_shares")
    what = "blocks" if "pipeline_stage_layers" in part else "samples"
    time = f", {part['micro_batch_s']:.3f} s per micro-batch" if "micro_batch_s" in part else ""
    memory = f"{part['memory_gb']:.1f} of {part['usable_gb']:.1f} GB"
    return (
        f"  {part['nodes']} x {part['gpus'] // part['nodes']} {part['gpu']:<6} {part['role']}: {what} "
        f"{'+'.join(map(str, work)) if work else '-'}; {memory}{time}"
    )


def _why(option: Option) -> str:
    """What the uneven work buys, in the clock's numbers."""
    parts = option.parts
    if option.kind == "pipeline" and len(parts) > 1:
        per_stage = [sum(p["pipeline_stage_layers"]) / len(p["stages"]) for p in parts]
        return (
            f"{parts[0]['gpu']} stages hold {per_stage[0]:.1f} blocks on average, {parts[-1]['gpu']} stages "
            f"{per_stage[-1]:.1f}, so each stage's micro-batch takes about as long ("
            + ", ".join(f"{p['micro_batch_s']:.3f} s on {p['gpu']}" for p in parts)
            + ")"
        )
    if option.kind == "data":
        shares = [f"{max(p['data_parallel_shares'])} samples per {p['gpu']} replica" for p in parts]
        return "the replicas' shares follow their GPUs' speed: " + ", ".join(shares)
    return "each group runs one island; they meet every sync_every steps"


def _outcome(option: Option, chosen: Option | None) -> str:
    if option.candidate is None or not option.candidate.plan.fits:
        return f"does not run: {option.note or 'does not fit'}"
    step = option.step_time_s
    text = f"{step:.1f} s per step ({settings(option.candidate).split(', ')[0]})"
    if chosen is option:
        return text + ", chosen"
    if chosen is not None:
        text += f"; the chosen plan is {step / chosen.step_time_s:.2f}x as fast"
    return text
