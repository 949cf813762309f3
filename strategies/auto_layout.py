"""``--trainer.strategy=3d_auto`` (``Parallel3DStrategy(auto_layout=True)``): the planner chooses the layout at launch.

Before any process group exists, the strategy asks the planner (`lit3d.planner.plan`) for its fastest plan that fits
this cluster (the ranks and nodes launched, the GPU PyTorch reports and its memory; on CPU ranks a ``lit3d calibrate``
profile or this machine's share of cores and memory), this model and this data (sequence length, global batch,
precision, LoRA). Every rank asks the same question of the same arithmetic, so every rank gets the same answer.

It chooses what was left unset among the sizes, the ZeRO stage, the pipeline schedule and its micro-batches, recompute
and sequence parallelism, and the micro-batch size (so the trainer's gradient accumulation, unless given); it keeps
what was given. NOTE: a setting counts as given when it differs from the strategy's default: a default typed out on
the command line cannot be told from one left out (jsonargparse passes both).
"""

from __future__ import annotations

import time
from dataclasses import fields, replace
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lit3d.models.config import GPTConfig
from lit3d.parallel.settings import Parallelism, defaults
from lit3d.planner.calibrate import cluster_of
from lit3d.planner.hardware import cpu_share, identify
from lit3d.planner.inputs import GB, PEAK_BAND, PRECISIONS, Cluster, Training
from lit3d.planner.report import run_flags, settings
from lit3d.planner.request import Request, planning_defaults
from lit3d.planner.request import plan as plan_request
from lit3d.planner.search import Candidate, why

# Settings the planner does not weigh (how the run starts, saves and reports): never "given" to it.
NOT_PLANNED = (
    *("auto_layout", "auto_memory_gb", "plan_profile", "timeout", "start_method", "process_group_backend"),
    *("save_distributed_checkpoint", "async_checkpoint"),
)


def auto_cluster(
    device: torch.device, nodes: int, per_node: int, profile: str | None, memory_gb: float | None
) -> Cluster:
    """The cluster the launch plans for: ``memory_gb`` per rank when given, else the device's."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        gpu = identify(name)
        if gpu is None:
            raise ValueError(f"auto_layout=True: the planner does not know this GPU ({name}); give the sizes")
        memory = memory_gb or torch.cuda.get_device_properties(device).total_memory / GB
        return Cluster.of(gpu, nodes, per_node, gpu_memory_gb=memory)
    cluster = cluster_of(profile, per_node, nodes) if profile else Cluster.of(cpu_share(per_node), nodes, per_node)
    return replace(cluster, gpu_memory_gb=memory_gb) if memory_gb else cluster


def given_settings(parallelism: Parallelism) -> dict[str, Any]:
    """The settings that differ from the strategy's defaults and that the planner weighs."""
    default = defaults()
    return {
        f.name: getattr(parallelism, f.name)
        for f in fields(Parallelism)
        if f.name not in NOT_PLANNED and getattr(parallelism, f.name) != default.get(f.name)
    }


def auto_settings(strategy: Any, module: Any, trainer: Any, datamodule: Any) -> Parallelism:
    """The settings ``strategy`` (a `Parallel3DStrategy` with ``auto_layout``) runs: `choose`'s, on its cluster; the
    trainer's gradient accumulation set to the plan's; rank 0 logs the choice."""
    p = strategy.parallelism
    where = (strategy.root_device, strategy.num_nodes, strategy.num_processes, p.plan_profile, p.auto_memory_gb)
    chosen, accumulate, lines = choose(p, module, trainer, datamodule, auto_cluster(*where))
    if trainer is not None:
        trainer.accumulate_grad_batches = accumulate
    for line in lines:
        rank_zero_info(line)
    return chosen


def choose(parallelism: Parallelism, module: Any, trainer: Any, datamodule: Any, cluster: Cluster) -> tuple:
    """(the settings to run, the gradient accumulation, the lines rank 0 logs): the fastest plan that fits."""
    config = getattr(module, "config", None)
    if not isinstance(config, GPTConfig):
        raise ValueError(
            f"auto_layout=True plans a lit3d GPT; {type(module).__name__} is not one: give the sizes "
            "(tensor_parallel_size, pipeline_parallel_size, ...) instead"
        )
    given = given_settings(parallelism)
    accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
    batch, seq_len = getattr(datamodule, "global_batch_size", None), getattr(datamodule, "seq_len", None)
    if batch is None or seq_len is None:  # (never a layout chosen for a guessed batch)
        fed = "batches from a DataLoader" if datamodule is None else f"a {type(datamodule).__name__}"
        raise ValueError(
            f"auto_layout=True plans for the data's global_batch_size and seq_len, which {fed} does not say "
            f"(global_batch_size={batch}, seq_len={seq_len}): feed it a lit3d data module (TextDataModule, "
            "ChatDataModule, ...) or give the layout's sizes (tensor_parallel_size, pipeline_parallel_size, ...)"
        )
    precision = str(trainer.precision) if trainer is not None else "32-true"
    # NOTE: a layout is chosen only where its plan times the band measured peaks keep to fits the usable memory.
    headroom = 1 - (1 - Training.headroom) / PEAK_BAND
    best, misses, started = None, [], time.process_time()
    micros = [m for m in range(1, batch + 1) if batch % m == 0]
    for micro in micros:
        training = Training(
            seq_len=seq_len,
            micro_batch_size=micro,
            global_batch_size=batch,
            precision=precision if precision in PRECISIONS else "32-true",
            lora=getattr(module, "lora", None),
            headroom=headroom,
        )
        fixed = frozenset({*given, "micro_batch_size"})
        report = plan_request(Request(config, cluster, training, planning_defaults(**given), fixed, top=1))
        # (a gradient accumulation given keeps the micro-batches that run it)
        runs = [c for c in report.candidates if c.plan.fits and (accumulate == 1 or _accumulation(c) == accumulate)]
        best = min([*runs, *([best] if best else [])], key=lambda c: c.plan.step_time_s, default=None)
        misses += [report.nearest_miss] if report.nearest_miss else []
    if best is None:
        raise ValueError(_nothing_fits(config, cluster, misses))
    kept = {name: getattr(parallelism, name) for name in NOT_PLANNED}
    chosen = replace(best.settings_to_run(), **kept)
    lines = [
        f"3d_auto chose: {settings(best)}",
        f"  why: {why(best, cluster)}",
        f"  usable: {cluster.gpu_memory_gb * (1 - Training.headroom):.3g} GB a rank, planned within "
        f"1/{PEAK_BAND} of it (runs peak up to {PEAK_BAND}x their plan)",
        f"  the same run, written out: {run_flags(best, frozenset(given))}",
        f"  searched: {len(micros)} micro-batch size(s) in {time.process_time() - started:.2f} s of CPU",
    ]
    return chosen, _accumulation(best), lines


def _accumulation(candidate: Candidate) -> int:
    """The trainer's ``accumulate_grad_batches`` that runs ``candidate``: its micro-steps without a pipeline, else the
    schedules per step."""
    training, layout = candidate.training, candidate.layout
    if layout.pp > 1:
        return training.accumulate_grad_batches
    return training.global_batch_size // (layout.data_replicas * training.micro_batch_size)


def _nothing_fits(config: GPTConfig, cluster: Cluster, misses: list[Candidate]) -> str:
    text = (
        f"auto_layout=True: no layout of {config.name} fits {cluster.gpus} ranks of {cluster.gpu_memory_gb:g} GB "
        f"(less headroom, and room for runs that peak up to {PEAK_BAND}x their plan)"
    )
    if misses:
        nearest = min(misses, key=lambda c: c.plan.memory_per_gpu["total"])
        text += f"; the nearest needs {nearest.plan.memory_per_gpu['total'] / GB:.3g} GB per rank: {run_flags(nearest)}"
    return text
