"""``lit3d plan``: the command line of the planner (`lit3d.planner`). Its arguments are the cluster, the training
loop's numbers and every setting of the strategy (`_with_every_setting`); ``--fleet`` plans GPU kinds in one job,
``--html`` writes the planner's page."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import fields
from json import dumps
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from lit3d.models.config import PRESETS
from lit3d.models.lora_settings import LoRA
from lit3d.outputs import check_output
from lit3d.parallel.settings import Parallelism
from lit3d.planner import Cluster, RankMap, Request, format_report
from lit3d.planner import plan as plan_request
from lit3d.planner.explore import explore
from lit3d.planner.fit_config import read_fit_config, read_model, run_batches
from lit3d.planner.fleet import parse_fleet
from lit3d.planner.fleet_report import format_fleet, plan_fleet
from lit3d.planner.hardware import GPUS, identify
from lit3d.planner.launch import Launch, model_flag
from lit3d.planner.request import DILOCO_SYNC_EVERY, SEARCHED
from lit3d.planner.verify import Split
from lit3d.shipped import shipped_configs


def plan(
    model: str | None = None,
    config: str | None = None,
    search: bool = False,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    gpu: str | None = None,
    gpu_memory: float | None = None,
    intra_node_bandwidth: float | None = None,
    inter_node_bandwidth: float | None = None,
    peak_tflops: float | None = None,
    power_watts: float | None = None,
    seq_len: int | None = None,
    micro_batch_size: int | None = None,
    global_batch_size: int | None = None,
    precision: str | None = None,
    inter_island_bandwidth: float = 1.0,
    inter_island_latency: float = 10.0,
    top: int = 5,
    json: bool = False,
    verify: bool = False,
    map: str | None = None,
    fleet: str | None = None,
    html: str | None = None,
    overwrite: bool = False,
    **settings: Any,
) -> None:
    """Plan a layout: memory per GPU, communication, pipeline bubble and step time, before renting a GPU.

    With ``tensor_parallel_size`` and ``pipeline_parallel_size`` given, reports that layout; otherwise searches every
    layout of the cluster that keeps the settings given and prints the fastest that fit. Takes every strategy argument.

    Args:
    {run}
        nodes: Number of nodes (default 1).
        gpus_per_node: GPUs in each node (default 8).
        gpu: A known device ({gpus}; ``CPU``: one core each), a device's name as PyTorch reports it (``"NVIDIA H100
            80GB HBM3"``), or a profile that ``lit3d calibrate`` wrote (default ``H100``).
        gpu_memory: Memory of one GPU, GB.
        intra_node_bandwidth: GB/s per GPU and direction inside a node (NVLink).
        inter_node_bandwidth: GB/s per GPU between nodes (InfiniBand).
        peak_tflops: Dense bf16 peak of one GPU, TFLOP/s.
        power_watts: The GPUs' power limit, if below their rated power (it lowers the clock the step is priced at).
        seq_len: Tokens per sequence (default: the model's max_seq_len).
        micro_batch_size: Sequences per micro-batch (default 1, or global_batch_size / (dp x num_microbatches)).
        global_batch_size: Sequences per optimizer step over all replicas (default 1024).
        precision: ``bf16-mixed`` (2 + 2 + 12 bytes per parameter; the default), ``bf16-true`` or ``32-true``.
        inter_island_bandwidth: GB/s per GPU between DiLoCo's islands.
        inter_island_latency: Milliseconds per hop between islands.
        top: How many layouts a search prints.
        json: Print one JSON object instead of text.
        verify: Check the per-rank parameter counts against the real model parallelised in a fake process group.
        map: Draw the rank map (the layout's, or a search's best three) to this ``.svg``, ``.png`` or ``.html`` file.
        fleet: Node groups of GPU kinds in one job, in node-rank order, instead of ``--nodes`` and ``--gpu``:
            ``2x8xH100,6x8xA100`` (nodes x GPUs x kind); plans uneven work (docs/mixed-fleets.md).
        html: Write the planner's page to this file: every layout of the cluster to play with (docs/planner.md).
    {settings}
    """
    arguments, given, launch = _with_config(locals())
    return _plan_fleet(fleet, arguments, given) if fleet is not None else _plan_cluster(arguments, given, launch)


def command_line(args: list[str]) -> None:
    """``lit3d plan ARGS``: `plan` of the arguments parsed. NOTE: parsed here rather than by jsonargparse's ``CLI``,
    which drops a function's own ``config`` argument (it keeps ``--config`` for a file of the function's arguments)."""
    from jsonargparse import CLI, capture_parser

    parser = capture_parser(lambda: CLI(plan, args=[], as_positional=False, prog="lit3d plan"))
    plan(**parser.parse_args(args).as_dict())


# The settings a search chooses (with the micro-batches per schedule, and where ZeRO-2/3 accumulate gradients).
CHOSEN_BY_A_SEARCH = (*SEARCHED, "num_microbatches", "accumulate_unsharded")
# What `plan` plans where neither a flag nor the config says.
DEFAULTS = dict(model="llama-8b", nodes=1, gpus_per_node=8, gpu="H100", global_batch_size=1024, precision="bf16-mixed")


def _with_config(arguments: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Launch]:
    """The arguments of `plan`: each flag given, else the ``--config``'s value, else `DEFAULTS`, the model read
    (`read_model`); what they fix of the run (`_given_numbers`); and how the plan's ``lit3d fit`` command names the
    config and the model. A config's run splits its batch as the run does (`run_batches`) unless
    ``micro_batch_size`` is given."""
    settings, name, flagged_model = dict(arguments.pop("settings")), arguments["config"], arguments["model"]
    fit = read_fit_config(name) if name is not None else None
    searching = fit is not None and (arguments["search"] or fit.searches)
    if fit is not None:
        run = fit.settings
        if searching:  # of the strategy's settings, only those a search does not choose are the config's
            run = {k: v for k, v in fit.settings.items() if k in fit.written and k not in CHOSEN_BY_A_SEARCH}
        numbers = {k: v for k, v in fit.numbers.items() if not (searching and k == "accumulate_grad_batches")}
        for key, value in {"model": fit.model, **numbers, **run}.items():
            into = arguments if key in arguments else settings
            if into.get(key) is None:
                into[key] = value
    arguments = {**arguments, **{k: v for k, v in DEFAULTS.items() if arguments[k] is None}}
    if fit is not None and arguments["micro_batch_size"] is None:
        gpus, batch = arguments["nodes"] * arguments["gpus_per_node"], arguments["global_batch_size"]
        run = fit.settings if searching else {**fit.settings, **{k: v for k, v in settings.items() if v is not None}}
        batches = run_batches(run, gpus, batch, fit.numbers["accumulate_grad_batches"])
        if searching or "num_microbatches" not in batches:
            arguments["micro_batch_size"] = batches["micro_batch_size"]
        elif settings.get("num_microbatches") is None:  # (the micro-batch size follows from it)
            settings["num_microbatches"] = batches["num_microbatches"]
    model = flagged_model if fit is not None else arguments["model"]
    launch = Launch(name, model_flag(model) if model is not None else None, fit.written if fit else frozenset())
    given = _given_numbers(
        arguments["seq_len"], arguments["micro_batch_size"], arguments["global_batch_size"], settings
    )
    return {**arguments, "model": read_model(arguments["model"])}, given, launch


def _plan_cluster(arguments: dict[str, Any], given: dict[str, Any], launch: Launch) -> None:
    """``lit3d plan`` on one kind of GPU: the layout, or a search's best, printed; its rank map drawn; its page."""
    names = (
        "gpu",
        "nodes",
        "gpus_per_node",
        "gpu_memory",
        "intra_node_bandwidth",
        "inter_node_bandwidth",
        "peak_tflops",
        "inter_island_bandwidth",
        "inter_island_latency",
        "power_watts",
    )
    cluster = _cluster(*(arguments[name] for name in names))
    model, top, verify, precision = (arguments[name] for name in ("model", "top", "verify", "precision"))
    if arguments["html"]:
        _write_page(arguments["html"], model, cluster, precision, given, arguments["overwrite"])
    split = _strategy_split() if verify else None
    request = Request.given(model, cluster, top=top, verify=split, launch=launch, precision=precision, **given)
    report = plan_request(request)
    picture = arguments["map"]
    drawn = f"\nrank map: {RankMap.side_by_side(report.rank_maps()).save(picture)}" if picture and report.chosen else ""
    print(dumps(report.to_dict(), indent=2) if arguments["json"] else format_report(report) + drawn)
    if not report.verified_exactly:
        raise SystemExit("lit3d plan --verify: analytic and verified parameter counts differ")


def _strategy_split() -> Split:
    """What ``--verify`` checks the plan against: the strategy's own split, counted (torch and Lightning load here)."""
    from lit3d.strategies.split.count import held_params

    return held_params


def _write_page(
    path: str, model: str, cluster: Cluster, precision: str, given: dict[str, Any], overwrite: bool
) -> None:
    check_output(path, "planner page", is_page, overwrite=overwrite)  # before the page is planned
    page = explore(model, cluster, precision=precision, **given)
    page.save(path)
    print(
        f"wrote {path}: {len(page.data['layouts'])} layouts, {Path(path).stat().st_size / 1e6:.2f} MB; open it in a "
        "browser (it needs no network)"
    )


def is_page(path: Path) -> bool:
    """Whether ``path`` is a planner page lit3d wrote, which ``--html`` may replace: its title, as
    `lit3d.planner.page.render` writes it, in its first lines."""
    try:
        with open(path, encoding="utf-8") as file:
            return "<title>lit3d plan: " in file.read(300)
    except (OSError, ValueError):
        return False


def _given_numbers(
    seq_len: int | None, micro_batch_size: int | None, global_batch_size: int, settings: dict[str, Any]
) -> dict[str, Any]:
    """The training loop's numbers and the settings given to `lit3d plan` (None: not given; 0 is given)."""
    settings["lora"] = _lora(settings.pop("lora_rank", None), settings.pop("lora_targets", None))
    numbers = dict(seq_len=seq_len, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, **settings)
    return {name: value for name, value in numbers.items() if value is not None}


def _plan_fleet(fleet: str, arguments: dict[str, Any], given: dict[str, Any]) -> None:
    """``lit3d plan --fleet``: the arguments of `plan` that a fleet replaces are refused if given."""
    defaults = inspect.signature(plan).parameters
    replaced = [
        "nodes",
        "gpus_per_node",
        "gpu",
        "gpu_memory",
        "intra_node_bandwidth",
        "inter_node_bandwidth",
        "peak_tflops",
        "power_watts",
        "verify",
        "html",
        "top",
    ]
    clashing = [f"--{name}" for name in replaced if arguments[name] != DEFAULTS.get(name, defaults[name].default)]
    if clashing:
        raise ValueError(f"{', '.join(clashing)}: not with --fleet (it names the GPUs and plans one fleet layout)")
    groups = parse_fleet(
        fleet,
        inter_island_gbps=arguments["inter_island_bandwidth"],
        inter_island_latency_ms=arguments["inter_island_latency"],
    )
    report = plan_fleet(groups, arguments["model"], precision=arguments["precision"], **given)
    drawn = f"\nrank map: {report.rank_map().save(arguments['map'])}" if arguments["map"] and report.chosen else ""
    print(dumps(report.to_dict(), indent=2) if arguments["json"] else format_fleet(report) + drawn)


def _lora(rank: int | None, targets: list[str] | None) -> LoRA | None:
    if rank is None and targets:
        raise ValueError(f"lora_targets={targets!r} needs lora_rank (the adapters' rank)")
    return None if rank is None else LoRA(rank=rank, **({"targets": tuple(targets)} if targets else {}))


# The help of `plan`'s arguments written in at its ``{run}`` (its docstring is long): the run it plans, ``--overwrite``.
RUN_HELP = {
    "model": "A preset name ({presets}), a model YAML file, or a local HuggingFace folder or its ``config.json`` "
    "(default: ``llama-8b``, or the config's model).",
    "config": "A ``lit3d fit`` config, a file or the name of one shipped with lit3d ({configs}): plans exactly the run "
    "it describes: its model, the data's ``seq_len`` and ``global_batch_size``, the trainer's ``num_nodes``, "
    "``devices``, ``precision`` and ``accumulate_grad_batches``, and the strategy's settings. The flags given "
    "override it.",
    "search": "With ``--config``: search the cluster for the config's model and data (its micro-batch size and the "
    "settings a search does not choose kept) instead of planning the config's layout. Without one, what ``lit3d "
    "plan`` does anyway unless ``tensor_parallel_size`` and ``pipeline_parallel_size`` are given.",
    "overwrite": "Replace a file at ``--html`` that is not a page lit3d wrote (one it wrote is replaced anyway).",
}
# What `lit3d plan` plans of the training beyond its loop's numbers: name -> (type, help), flags as the settings are.
TRAINING_FLAGS = {
    "lora_rank": (int, "LoRA: adapters of this rank train, every other weight frozen (no gradients, no optimizer "
                  "states)."),
    "lora_targets": (list[str], "The adapted linears by role (``q``, ``k``, ``v``, ``o``, ``gate``, ``up``, ``down``; "
                     "default ``q`` and ``v``, as `lit3d.LoRA`'s)."),
    "headroom": (float, "Share of each GPU's memory a layout must leave free for the allocator's cache, the CUDA "
                 "context and the communication buffers (default 0.1); below it for a stack known to run closer to "
                 "the card."),
    "optimizer": (str, "``adamw`` (default) or ``muon``: Muon's hidden matrices keep one momentum, not AdamW's two "
                  "moments (`lit3d.GPT`'s ``optimizer``)."),
    "document_length": (int, "Tokens of packed documents kept apart (``document_masking``, chat data): the model "
                        "FLOPs and MFU count only the attention within each."),
}  # fmt: skip


def _cluster(
    gpu: str,
    nodes: int,
    gpus_per_node: int,
    gpu_memory: float | None,
    intra_node_bandwidth: float | None,
    inter_node_bandwidth: float | None,
    peak_tflops: float | None,
    inter_island_bandwidth: float,
    inter_island_latency: float,
    power_watts: float | None = None,
) -> Cluster:
    """The `lit3d.planner.Cluster` of ``nodes`` x ``gpus_per_node`` of ``gpu`` (a known device, or a profile that
    `lit3d calibrate` wrote), the numbers given replacing its own."""
    latency = {}
    if gpu.endswith(".json"):
        from lit3d.planner.calibrate import load_profile

        spec, measured = load_profile(gpu)
        latency = dict(collective_latency_us=measured, intra_node_hop_us=0.0, inter_node_hop_us=0.0)
    elif gpu in GPUS:
        spec = GPUS[gpu]
    elif identify(gpu) is not None:  # a device's name as PyTorch reports it: "NVIDIA H100 80GB HBM3"
        spec = identify(gpu)
    else:
        raise ValueError(
            f"gpu={gpu!r} is not one of {', '.join(GPUS)}, nor a device name lit3d/planner/hardware.py knows "
            "(`torch.cuda.get_device_name()`), nor a profile (.json) of `lit3d calibrate`; give gpu_memory, "
            "bandwidths and peak_tflops"
        )
    given = {
        "gpu_memory_gb": gpu_memory,
        "intra_node_gbps": intra_node_bandwidth,
        "peak_tflops": peak_tflops,
        "inter_node_gbps": inter_node_bandwidth,
    }
    numbers = {name: value for name, value in given.items() if value is not None}  # NOTE: 0 is given (and refused)
    islands = dict(inter_island_gbps=inter_island_bandwidth, inter_island_latency_ms=inter_island_latency)
    return Cluster.of(spec, nodes, gpus_per_node, **numbers, **latency, **islands, power_watts=power_watts)


# How `lit3d plan` uses each setting of the strategy, after the setting's own help (`Parallelism`'s field metadata).
PLAN_NOTES = {
    "data_parallel_size": "Planned: what tensor, context and pipeline parallelism leave of the cluster unless given.",
    "tensor_parallel_size": "Searched when not given; given with ``pipeline_parallel_size``, the plan is that layout.",
    "pipeline_parallel_size": "Searched when not given; given with ``tensor_parallel_size``, the plan is that layout.",
    "expert_parallel_size": "Searched (an MoE model) when not given.",
    "context_parallel_size": "Searched when not given for sequences of 16k tokens and more (1 otherwise).",
    "zero_stage": "Searched when not given (1 for a fixed layout).",
    "sequence_parallel": "Planned on unless given.",
    "pipeline_schedule": "When not given, each layout runs the schedule and micro-batch count with the shortest step "
    "that fits (``--json``: ``pipeline_schedule`` and every candidate's bubble in ``schedule_candidates``).",
    "num_microbatches": "Needs a fixed layout; sets micro_batch_size.",
    "virtual_pipeline_size": "Searched with the schedule when not given.",
    "activation_checkpointing": "Searched (off or full) when not given, off for a fixed layout.",
    "mixed_precision_reduce": "Planned as the run reduces: ``bfloat16`` halves the gradients' bytes.",
    "compile": "Planned: each block's elementwise work fused, its memory-bound time cut.",
    "islands": "The plan then prints the time per outer step and what it saves against synchronous DP.",
    "sync_every": f"Planned: {DILOCO_SYNC_EVERY} (DiLoCo's paper) with islands unless given.",
    "outer_fragments": "The same bytes, fewer at a time.",
    "offload": "Planned (ZeRO-3 unless given): the states in host memory (``host memory``), each step's copies over "
    "the host link and the CPU optimizer step in the step time.",
    "replica_groups": "Planned: the plan is one group's (the nodes and the batch given: one group's share); each step "
    "adds the groups' all-reduce of the gradients (``replica`` bytes, over the network, in the step time); printed: "
    "what a group that rejoins loads a GPU from a live one.",
}
NOT_PLANNED = "Accepted; the plan does not depend on it."


def _with_every_setting(command: Callable[..., None]) -> None:
    """Give ``command`` (whose ``**settings`` take them) a keyword for every field of `Parallelism`, typed as the
    field (or None: not given) and documented with its help and `PLAN_NOTES`: what jsonargparse makes flags of, so a
    new setting of the strategy is a flag of ``lit3d plan`` unedited."""
    types, signature = get_type_hints(Parallelism), inspect.signature(command)
    explicit = [
        p.replace(annotation=get_type_hints(command)[p.name])
        for p in signature.parameters.values()
        if p.kind is not p.VAR_KEYWORD
    ]
    keyword = lambda name: inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=_choices_as_str(types[name]) | None
    )
    extra = [keyword(f.name) for f in fields(Parallelism)]
    extra += [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=hint | None)
        for name, (hint, _) in TRAINING_FLAGS.items()
    ]
    command.__signature__ = signature.replace(parameters=explicit + extra)  # type: ignore[attr-defined]
    lines = [f"        {name}: {text}\n" for name, (_, text) in TRAINING_FLAGS.items()]
    lines += [
        f"        {f.name}: {f.metadata['help']} {PLAN_NOTES.get(f.name, NOT_PLANNED)}\n" for f in fields(Parallelism)
    ]
    if command.__doc__:  # (None under python -OO)
        presets = ", ".join(f"``{name}``" for name in PRESETS)
        doc = re.sub(r"^ *\{settings\}\n", lambda _: "".join(lines), command.__doc__, flags=re.MULTILINE)
        run = "".join(f"        {name}: {text}\n" for name, text in RUN_HELP.items())
        doc = re.sub(r"^ *\{run\}\n", lambda _: run, doc, flags=re.MULTILINE)
        doc = doc.replace("{presets}", presets).replace("{gpus}", ", ".join(GPUS))
        command.__doc__ = doc.replace("{configs}", ", ".join(f"``{name}``" for name in shipped_configs()))


def _choices_as_str(hint: Any) -> Any:
    """``hint`` with each ``Literal`` of choices read as a ``str``: `Parallelism.check` then refuses a wrong one in one
    line naming it and the choices, as every other bad setting (jsonargparse's own refusal is a page)."""
    if get_origin(hint) is Literal:
        return str
    if get_origin(hint) in (Union, UnionType):
        return Union[tuple(dict.fromkeys(_choices_as_str(arg) for arg in get_args(hint)))]  # noqa: UP007
    return hint


# The settings that may be true (``--async_checkpoint``): flags that may stand alone (`lit3d.cli`).
SWITCHES = tuple(f"--{name}" for name, hint in get_type_hints(Parallelism).items() if bool in (hint, *get_args(hint)))

# NOTE: the lists come from the tables themselves, so a new preset, device or setting shows in `lit3d plan --help`
# unedited.
_with_every_setting(plan)
