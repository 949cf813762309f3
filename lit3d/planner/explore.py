"""The planner as a page to play with: every layout its controls can reach, planned in Python and embedded as data
(`page_data`), drawn by a self-contained HTML page (`lit3d.planner.page`): ``lit3d plan ... --html FILE``, or
`explore` in a notebook.

Each layout is planned as ``lit3d plan --json`` plans it with its sizes, ZeRO stage and pipeline schedule given
(`lit3d.planner.request.plan`), so a GPU's numbers on the page are that command's. The page's script only selects
and draws them.
"""

from __future__ import annotations

from dataclasses import asdict
from itertools import product
from typing import Any

from lit3d.models.config import GPTConfig
from lit3d.parallel.layout import ZERO_STAGES
from lit3d.planner.estimate import GB, Cluster
from lit3d.planner.page import render
from lit3d.planner.request import Request, plan
from lit3d.planner.search import context_parallel_sizes, divisors

COMPONENTS = ("params", "grads", "optimizer", "activations", "buffers", "host", "total")  # a stage's memory row
AXES = ("tp", "cp", "dp", "pp", "ep")
DEFAULT_SCHEDULE = "1f1b"  # the page's pipelines, unless the plan is given another


def page_data(model: GPTConfig | str, cluster: Cluster | None = None, **given: Any) -> dict[str, Any]:
    """Every layout of ``model`` the page's controls reach on ``cluster`` (d, t, p, and ep, cp where the model has
    them; each ZeRO stage), each planned as `lit3d plan` plans it, with why it cannot run or does not fit; and the
    ranking of those that fit. ``given``: as `Request.given` (the sizes and ZeRO stage are the controls'; HSDP's
    ``data_parallel_shard_size`` applies where it splits the replicas of a ZeRO-1-3 layout, whose ``shard`` it is)."""
    config, cluster = GPTConfig.load(model), cluster or Cluster()
    given = {"pipeline_schedule": DEFAULT_SCHEDULE, **given}
    for name in (
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "expert_parallel_size",
        "context_parallel_size",
        "zero_stage",
    ):
        given.pop(name, None)
    shard = given.pop("data_parallel_shard_size", None)  # HSDP's groups, on every layout whose replicas they split
    training = Request.given(config, cluster, **given).training
    axes = _axis_values(config, cluster, training)
    rows: dict[tuple[int, ...], int] = {}  # distinct memory rows (a long pipeline's middle stages repeat)
    layouts = {}
    for t, p, ep, cp, zero in product(axes["t"], axes["p"], axes["ep"], axes["cp"], ZERO_STAGES):
        for d in divisors(cluster.gpus // (t * p * cp)):
            sizes = dict(
                tensor_parallel_size=t,
                pipeline_parallel_size=p,
                data_parallel_size=d,
                expert_parallel_size=ep,
                context_parallel_size=cp,
                zero_stage=zero,
                data_parallel_shard_size=shard if shard and zero and d % shard == 0 and shard < d else None,
            )
            layouts[layout_key(d, t, p, ep, cp, zero)] = _layout_entry(config, cluster, given, sizes, rows)
    return {
        "model": {"name": config.name, "params": config.num_params, "n_layer": config.n_layer},
        "replica_groups": given.get("replica_groups") or 1,  # each a copy of the layout shown, on nodes of its own
        "cluster": {
            **{k: v for k, v in asdict(cluster).items() if k not in ("gpu", "stage_gpus")},
            "gpu": cluster.gpu.name,
            "gpus": cluster.gpus,
        },
        "training": {
            "seq_len": training.seq_len,
            "global_batch_size": training.global_batch_size,
            "micro_batch_size": training.micro_batch_size,
            "precision": training.precision,
            "pipeline_schedule": given["pipeline_schedule"],
            "usable_gb": cluster.gpu_memory_gb * (1 - training.headroom),
        },
        "axes": {**axes, "zero": list(ZERO_STAGES)},
        "components": list(COMPONENTS),
        "rows": [list(row) for row in rows],
        "layouts": layouts,
        "ranking": ranking(layouts),
    }


def layout_key(d: int, t: int, p: int, ep: int, cp: int, zero: int) -> str:
    """How the page names a layout: ``d,t,p,ep,cp,zero``."""
    return f"{d},{t},{p},{ep},{cp},{zero}"


def ranking(layouts: dict[str, dict], top: int = 8) -> list[str]:
    """The fastest layouts that fit (ties: the fewest GPUs, then the least memory), best first."""
    fitting = [key for key, entry in layouts.items() if entry.get("fits")]
    return sorted(fitting, key=lambda k: (layouts[k]["step_s"], layouts[k]["gpus"], layouts[k]["memory"]))[:top]


def _axis_values(config: GPTConfig, cluster: Cluster, training: Any) -> dict[str, list[int]]:
    """The values each control offers: TP within a node, PP up to the model's blocks, EP over the experts, CP where
    the sequence is long enough (`lit3d.planner.search.context_parallel_sizes`)."""
    ep = [e for e in divisors(config.n_expert) if e <= cluster.gpus] if config.n_expert else [1]
    return {
        "t": divisors(cluster.gpus_per_node),
        "p": [p for p in divisors(cluster.gpus) if p <= config.n_layer],
        "ep": ep,
        "cp": context_parallel_sizes(training, cluster.gpus, None),
    }


def _layout_entry(
    config: GPTConfig, cluster: Cluster, given: dict[str, Any], sizes: dict[str, int], rows: dict
) -> dict[str, Any]:
    """One layout as `lit3d plan --json` plans it, compact: its stages' memory rows (indices into ``rows``), each
    axis's bytes and seconds per step, the step; or why it cannot run."""
    gpus = sizes["data_parallel_size"] * sizes["tensor_parallel_size"] * sizes["pipeline_parallel_size"]
    gpus *= sizes["context_parallel_size"]
    try:
        chosen = plan(Request.given(config, cluster, **given, **sizes)).chosen
    except ValueError as problem:
        return {"gpus": gpus, "error": str(problem)}
    p = chosen.plan
    stages = []
    for stage in p.memory_by_stage:
        row = tuple(int(stage.get(name, 0)) for name in COMPONENTS)
        stages.append(rows.setdefault(row, len(rows)))
    usable = cluster.gpu_memory_gb * (1 - chosen.training.headroom)
    entry = {
        "gpus": gpus,
        "fits": p.fits,
        "step_s": p.step_time_s,
        "mfu": p.mfu,
        "bubble": p.pipeline_bubble,
        "microbatches": p.num_microbatches,
        "memory": p.memory_per_gpu["total"],
        "stages": stages,
        **({"shard": sizes["data_parallel_shard_size"]} if sizes["data_parallel_shard_size"] else {}),
        **({"rejoin": p.rejoin_bytes()} if (given.get("replica_groups") or 1) > 1 else {}),
        "comm": {
            axis: [c["bytes"], c["seconds"], c["link_gbps"]]
            for axis, c in p.communication_per_step.items()
            if c["bytes"]
        },
    }
    if not p.fits:
        entry["error"] = f"needs {p.memory_per_gpu['total'] / GB:.1f} GB on its most loaded GPU, {usable:.1f} GB usable"
    return entry


class Explorer:
    """The page of a model on a cluster, for a notebook (``_repr_html_``: inline, in a sandboxed frame) or a file."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def html(self) -> str:
        return render(self.data)

    def save(self, path: str) -> str:
        with open(path, "w", encoding="utf-8") as file:
            file.write(self.html())
        return path

    def _repr_html_(self) -> str:
        import html

        return (
            f'<iframe srcdoc="{html.escape(self.html(), quote=True)}" style="width:100%;height:760px;border:0" '
            'sandbox="allow-scripts"></iframe>'
        )


def explore(model: GPTConfig | str, cluster: Cluster | None = None, **given: Any) -> Explorer:
    """The planner's page for ``model`` on ``cluster`` (default: 8 H100s): shows itself in a notebook; ``.save(path)``
    writes it. ``given``: the training loop's numbers and settings, as ``lit3d plan``'s."""
    return Explorer(page_data(model, cluster, **given))
