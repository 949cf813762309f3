"""The planner as one function, `plan(request) -> Report`: what ``lit3d plan`` runs, and a running fit's estimate.

A `Request` is a model on a `Cluster`, the training loop's numbers (`Training`) and the run's settings (a
`lit3d.parallel.Parallelism`, the value the strategy is built from), with the names of the settings the user fixed.
With the tensor- and pipeline-parallel sizes fixed, the plan is that one layout (its schedule chosen if not fixed);
otherwise a search over every layout of the cluster keeps what is fixed and chooses the rest. The `Report` holds the
candidates, best first, with what the text and JSON outputs need (`format_report`,
`Report.to_dict`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from lit3d.models.config import GPTConfig
from lit3d.parallel.layout import ZERO_STAGES, Layout, check_islands, check_shard_groups, check_sizes
from lit3d.parallel.settings import Parallelism
from lit3d.planner.calibration import STATIC_POWER_SHARE
from lit3d.planner.estimate import PLANNING_DEFAULTS, Cluster, Training, estimate
from lit3d.planner.inputs import PRECISIONS
from lit3d.planner.islands import format_islands, versus_synchronous
from lit3d.planner.launch import Launch, fit_command
from lit3d.planner.pipeline import candidates, choose_schedule
from lit3d.planner.rankmap import RankMap
from lit3d.planner.report import format_plan, format_search, format_verify, run_flags
from lit3d.planner.search import Candidate, layout_problem, search
from lit3d.planner.verify import Split, StageCount, verify

# The sizes a search keeps when they are fixed, and chooses otherwise (with, per layout, the ZeRO stage, recompute, the
# pipeline schedule and its chunks per rank: `SEARCHED`).
SIZES = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "expert_parallel_size",
    "context_parallel_size",
)
SEARCHED = (*SIZES, "zero_stage", "activation_checkpointing", "pipeline_schedule", "virtual_pipeline_size")
DILOCO_SYNC_EVERY = 500  # inner steps per outer step planned with islands unless given (DiLoCo's paper)


@dataclass(frozen=True)
class Request:
    """What to plan.

    Args:
        model: A `GPTConfig`, a preset name or a model YAML file.
        cluster: The GPUs, their memory, peak and links.
        training: The training loop's numbers (sequence length, batch sizes, precision, headroom, its software).
        parallelism: The run's settings. Those named in ``fixed`` are kept; of the others, the planner chooses the
            ones in `SEARCHED` (sizes, ZeRO stage, recompute, schedule) and takes the rest as they are.
        fixed: The names of the settings given (fields of `Parallelism`, and ``micro_batch_size``, which is otherwise
            derived from a fixed ``num_microbatches``). With ``tensor_parallel_size`` and ``pipeline_parallel_size``
            fixed, the plan is that layout; otherwise a search.
        top: How many layouts a search reports (JSON: the best and ``top - 1`` alternatives).
        verify: The strategy's split, counted (`lit3d.strategies.split.count.held_params`, which imports torch and
            the strategy): with it, the real model is parallelised on the meta device for the chosen layout and its
            per-rank parameter counts are set beside the planner's (`lit3d.planner.verify`).
        launch: How the ``lit3d fit`` command that runs the plan names its config and model (`fit_command`).
    """

    model: GPTConfig | str = "llama-8b"
    cluster: Cluster = field(default_factory=Cluster)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = PLANNING_DEFAULTS
    fixed: frozenset[str] = frozenset()
    top: int = 5
    verify: Split | None = None
    launch: Launch = Launch()

    @classmethod
    def given(
        cls,
        model: GPTConfig | str,
        cluster: Cluster | None = None,
        *,
        top: int = 5,
        verify: Split | None = None,
        launch: Launch | None = None,
        **given: Any,
    ) -> Request:
        """A request that fixes the settings ``given`` by name (fields of `Training` and of `Parallelism`) and
        leaves the rest to the planner: ``seq_len`` the model's longest, the other numbers `Training`'s defaults,
        the settings `planning_defaults`."""
        config = GPTConfig.load(model)
        for name in ("data_parallel_size", "tensor_parallel_size"):
            if given.get(name) == "auto":
                del given[name]  # (for the planner to choose: not fixed)
        if (given.get("offload") or given.get("float8_all_gather")) and "zero_stage" not in given:
            given["zero_stage"] = 3  # what offloading and FP8 gathers run
        numbers = {f.name: given.pop(f.name) for f in fields(Training) if f.name in given}
        training = Training(**{"seq_len": config.max_seq_len, **numbers})
        return cls(
            config,
            cluster or Cluster(),
            training,
            planning_defaults(**given),
            frozenset({*numbers, *given}),
            top,
            verify,
            launch or Launch(),
        )

    @property
    def fixes_layout(self) -> bool:
        return {"tensor_parallel_size", "pipeline_parallel_size"} <= self.fixed

    def fixed_value(self, name: str) -> Any:
        """The setting ``name`` if it is fixed, else None."""
        return getattr(self.parallelism, name) if name in self.fixed else None


def planning_defaults(**given: Any) -> Parallelism:
    """The settings a plan assumes: those ``given``, else `PLANNING_DEFAULTS` (sequence parallelism on), with
    DiLoCo's islands an outer step every `DILOCO_SYNC_EVERY` inner steps, and until the search chooses a pipeline
    schedule, 1F1B or the first candidate that runs the chunks and micro-batches given."""
    islands = given.get("islands", 1)
    assumed = {"sync_every": DILOCO_SYNC_EVERY} if isinstance(islands, int) and islands > 1 else {}
    if "pipeline_schedule" in given:
        return replace(PLANNING_DEFAULTS, **{**assumed, **given})
    names = ["1f1b", *(name for name, _ in candidates(None, given.get("virtual_pipeline_size")))]
    problems = []
    for name in dict.fromkeys(names):
        try:
            return replace(PLANNING_DEFAULTS, **{**assumed, "pipeline_schedule": name, **given})
        except ValueError as problem:
            problems.append(problem)
    raise problems[0]


@dataclass
class Report:
    """What a plan found.

    Attributes:
        request: What was asked.
        config: The model.
        candidates: The layout of a fixed layout (fitting or not), or a search's layouts that fit, best first.
        dropped: A search's count of layouts dropped, by reason (``invalid``, ``out_of_memory``); None for one layout.
        islands: With DiLoCo's islands, the chosen layout's outer step against synchronous DP
            (`lit3d.planner.islands.versus_synchronous`).
        verified: ``--verify``'s per-stage parameter counts of the chosen layout, real against planned.
        nearest_miss: When nothing fits a search, the layout that needs the least memory.
    """

    request: Request
    config: GPTConfig
    candidates: list[Candidate]
    dropped: dict[str, int] | None = None
    islands: dict[str, Any] | None = None
    verified: list[StageCount] | None = None
    nearest_miss: Candidate | None = None

    @property
    def searched(self) -> bool:
        return self.dropped is not None

    @property
    def chosen(self) -> Candidate | None:
        """The layout planned, or the search's best (None if nothing fits)."""
        return self.candidates[0] if self.candidates else None

    @property
    def verified_exactly(self) -> bool:
        return all(count.matches for count in self.verified or [])

    def to_dict(self) -> dict[str, Any]:
        """``lit3d plan --json``: the chosen plan's numbers (a search's alternatives and drops beside them)."""
        best = self.chosen
        report = best.plan.to_dict() if best else {"layout": None}
        if self.searched:
            alternatives = [c.plan.to_dict() for c in self.candidates[1 : self.request.top]]
            report.update(alternatives=alternatives, dropped=self.dropped)
        report.update(model=self.config.name, cluster=asdict(self.request.cluster), fits=report.get("fits", False))
        if best:
            report["command"] = self.command(best)
        if self.nearest_miss:
            report["nearest_miss"] = self.nearest_miss.plan.to_dict()
        if self.islands:
            report["islands"] = self.islands
        if self.verified is not None:
            report["verify"] = [
                {"stage": c.stage, "rank": c.rank, "verified": c.verified, "analytic": c.analytic}
                for c in self.verified
            ]
        return report

    def command(self, candidate: Candidate) -> str:
        """The ``lit3d fit`` command that runs ``candidate`` as planned."""
        request = self.request
        flags = run_flags(candidate, request.fixed)
        return fit_command(candidate, request.cluster, self.config, request.launch, flags)

    def rank_maps(self) -> list[RankMap]:
        """The rank map of the layout, or of a search's best three."""
        device = self.request.cluster.device
        shown = self.candidates if not self.searched else self.candidates[:3]
        titles = [f"#{i} {self.config.name}" if self.searched else self.config.name for i in range(1, len(shown) + 1)]
        return [
            RankMap(c.layout, title, c.plan, device, replica_groups=c.parallelism.replica_groups or 1)
            for title, c in zip(titles, shown)
        ]


def plan(request: Request) -> Report:
    """The plan of ``request``: its layout, or the layouts a search finds, with DiLoCo's comparison and ``verify``'s
    counts for the chosen one. Refuses what no layout could run, naming the values."""
    config, cluster, settings = GPTConfig.load(request.model), request.cluster, request.parallelism
    check_inputs(config, cluster, request.training)
    if settings.data_parallel_shares is not None:  # NOTE: what a fleet plan will choose; not priced yet
        raise ValueError(
            f"data_parallel_shares={list(settings.data_parallel_shares)}: lit3d plan prices even "
            "data-parallel replicas only; plan without it"
        )
    if settings.float8 and not cluster.gpu.fp8_tflops and cluster.gpu.device == "GPU":
        raise ValueError(
            f"float8={settings.float8!r} on {cluster.gpu.name}: it has no FP8 tensor cores (Hopper, Ada, "
            "Blackwell and MI300X have)"
        )
    if settings.islands > 1 and cluster.gpus % settings.islands:
        raise ValueError(f"islands={settings.islands} does not divide the {cluster.gpus} GPUs of the cluster")
    if request.verify and not callable(request.verify):  # (``verify=True`` until 0.4)
        raise TypeError(
            f"verify={request.verify!r}: give the strategy's split to check against, "
            "verify=lit3d.strategies.split.count.held_params (the planner does not import the strategy)"
        )
    check_sizes(top=request.top)
    report = _one_layout(request, config) if request.fixes_layout else _search(request, config)
    chosen = report.chosen
    if chosen and chosen.layout.islands > 1:
        report.islands = versus_synchronous(config, cluster, chosen)
    if request.verify and chosen:
        report.verified = verify(config, chosen.layout, chosen.parallelism, request.verify)
    return report


def check_inputs(config: GPTConfig, cluster: Cluster, training: Training) -> None:
    """Refuse numbers no layout could use, naming them (the settings check themselves: `Parallelism.check`)."""
    check_sizes(nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node)
    for name, value in (
        ("gpu_memory", cluster.gpu_memory_gb),
        ("intra_node_bandwidth", cluster.intra_node_gbps),
        ("inter_node_bandwidth", cluster.inter_node_gbps),
        ("peak_tflops", cluster.peak_tflops),
    ):
        if not value > 0:
            raise ValueError(f"{name}={value!r} must be positive")
    power, idle = cluster.power_watts, STATIC_POWER_SHARE * cluster.gpu.tdp_watts
    if power is not None and not power > idle:
        raise ValueError(
            f"power_watts={power!r} must be above the {cluster.gpu.name}'s idle power ({idle:g} W of its "
            f"{cluster.gpu.tdp_watts:g} W)"
        )
    if training.lora is not None:
        training.lora.check_model(config)
    software = training.software
    for name in ("tp_overlap", "recomputed_matmuls"):
        share = getattr(software, name)
        if share is not None and not 0 <= share <= 1:
            raise ValueError(f"Software.{name}={share!r} must be a share between 0 and 1")
    if not software.offloaded_layers >= 0:
        raise ValueError(f"Software.offloaded_layers={software.offloaded_layers!r} must be 0 or more blocks")
    if software.loss_bytes not in (2, 4):
        raise ValueError(f"Software.loss_bytes={software.loss_bytes!r} must be 2 (bf16) or 4 (fp32)")
    if not software.loss_gradient_bytes >= 0:
        raise ValueError(f"Software.loss_grad_bytes={software.loss_grad_bytes!r} must be 0 or more bytes")
    bandwidth, latency = cluster.inter_island_gbps, cluster.inter_island_latency_ms
    if not bandwidth > 0 or not latency >= 0:
        raise ValueError(
            f"inter_island_bandwidth={bandwidth!r} must be positive and inter_island_latency={latency!r} at least 0"
        )
    check_sizes(
        seq_len=training.seq_len,
        micro_batch_size=training.micro_batch_size,
        global_batch_size=training.global_batch_size,
    )
    if training.seq_len > config.max_seq_len:
        raise ValueError(f"seq_len={training.seq_len} is above the model's max_seq_len={config.max_seq_len}")
    if training.document_length is not None:
        check_sizes(document_length=training.document_length)
    if training.precision not in PRECISIONS:
        raise ValueError(f"precision={training.precision!r} is not one of {', '.join(PRECISIONS)}")
    if not 0 <= training.headroom < 1:
        raise ValueError(f"headroom={training.headroom!r} must be a share of GPU memory, at least 0 and below 1")


def _one_layout(request: Request, config: GPTConfig) -> Report:
    """The layout of the fixed sizes, with the schedule (and micro-batches) that fit best unless fixed."""
    cluster, training, settings = request.cluster, request.training, request.parallelism
    tp, pp, cp = settings.tensor_parallel_size, settings.pipeline_parallel_size, settings.context_parallel_size
    dp, ep, islands = request.fixed_value("data_parallel_size"), settings.expert_parallel_size, settings.islands
    if dp is None and cluster.gpus % (tp * pp * cp):
        raise ValueError(
            f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} x context_parallel_size={cp} does not "
            f"divide the {cluster.gpus} GPUs of the cluster; give data_parallel_size"
        )
    dp = dp or cluster.gpus // (tp * pp * cp)  # every island's replicas
    check_islands(islands, dp, ep, cp)
    if dp % ep:
        raise ValueError(f"expert_parallel_size={ep} does not divide data_parallel_size={dp}")
    shard = check_shard_groups(settings.data_parallel_shard_size, dp // islands)
    layout = Layout(dp // islands, tp, pp, cluster.gpus_per_node, ep, cp, islands, shard)
    training, settings = _micro_batches(request, dp), settings.at(layout)
    schedule_fixed = "pipeline_schedule" in request.fixed
    # NOTE: GPipe runs any micro-batch count on one chunk: the layout check leaves the schedules to `choose_schedule`.
    checked = settings if schedule_fixed else replace(settings, pipeline_schedule="gpipe", virtual_pipeline_size=None)
    problem = layout_problem(config, cluster, layout, training, checked)
    if problem:
        raise ValueError(problem)
    chosen = None
    if pp > 1 and not schedule_fixed:
        schedules = candidates(None, request.fixed_value("virtual_pipeline_size"))
        chosen = choose_schedule(config, cluster, layout, training, settings, schedules)
    chosen = chosen or (training, settings, estimate(config, cluster, layout, training, settings))
    return Report(request, config, [Candidate(layout, *chosen)])


def _micro_batches(request: Request, dp: int) -> Training:
    """``request.training``, its micro-batch size derived from a fixed ``num_microbatches`` over ``dp`` replicas (and
    gradient accumulation's micro-steps), or checked against it when fixed too."""
    training, m = request.training, request.parallelism.num_microbatches
    if m is None:
        return training
    batch, steps = training.global_batch_size, m * training.accumulate_grad_batches
    accumulating = f" x accumulate_grad_batches={training.accumulate_grad_batches}" if steps > m else ""
    if batch % (dp * steps):
        raise ValueError(
            f"global_batch_size={batch} is not divisible by data_parallel_size={dp} x num_microbatches="
            f"{m}{accumulating}"
        )
    derived = batch // (dp * steps)
    if "micro_batch_size" in request.fixed and training.micro_batch_size != derived:
        raise ValueError(
            f"micro_batch_size={training.micro_batch_size} disagrees with global_batch_size={batch} / "
            f"(data_parallel_size={dp} x num_microbatches={m}{accumulating}) = {derived}"
        )
    return replace(training, micro_batch_size=derived)


def _search(request: Request, config: GPTConfig) -> Report:
    """Every layout of the cluster that keeps what is fixed, those that fit best first."""
    settings = request.parallelism
    m = settings.num_microbatches
    if m is not None:
        raise ValueError(
            f"num_microbatches={m} needs a fixed layout (tensor_parallel_size and pipeline_parallel_size); give "
            "micro_batch_size for a search"
        )
    sizes = {name: request.fixed_value(name) for name in SIZES}
    if sizes["data_parallel_size"]:
        sizes["data_parallel_size"] //= settings.islands  # (of one island)
    zero, checkpointing = request.fixed_value("zero_stage"), request.fixed_value("activation_checkpointing")
    schedules = candidates(request.fixed_value("pipeline_schedule"), request.fixed_value("virtual_pipeline_size"))
    misses: list[Candidate] = []
    fitting, dropped = search(
        config,
        request.cluster,
        request.training,
        settings,
        **sizes,
        zero_stages=ZERO_STAGES if zero is None else (zero,),
        checkpointing=(False, True) if checkpointing is None else (checkpointing,),
        pipeline_schedules=schedules,
        misses=misses,
    )
    nearest = None if fitting else min(misses, key=lambda c: c.plan.memory_per_gpu["total"], default=None)
    return Report(request, config, fitting, dropped, nearest_miss=nearest)


def format_report(report: Report) -> str:
    """What ``lit3d plan`` prints: the layout (or the search's best), DiLoCo's comparison, ``--verify``'s counts."""
    request = report.request
    if report.searched:
        best = report.command(report.chosen) if report.chosen else None
        text = format_search(
            report.config,
            request.cluster,
            report.candidates,
            report.dropped,
            request.top,
            request.fixed,
            best,
            report.nearest_miss,
        )
    else:
        text = format_plan(report.config, request.cluster, report.chosen)
        if report.chosen.plan.fits:
            text += f"\nrun it with: {report.command(report.chosen)}"
    if report.islands:
        text += "\n" + format_islands(report.islands)
    if report.verified is not None:
        text += "\n" + format_verify(report.chosen.layout, report.verified)
    return text
