"""Every run checks its plan: `PlanCheck` measures a fit's step time and its largest rank's peak memory after its
first steps, and rank 0 logs them against the planner's estimate of the same run (`lit3d.planner.run.plan_of_run`)
as ``plan/step_time_ratio`` and ``plan/peak_memory_ratio`` (measured / planned).

The step is priced on the device the run has: the GPU PyTorch reports (`lit3d.planner.hardware.identify`), or on CPU
ranks the profile ``lit3d calibrate`` wrote (``Parallel3DStrategy(plan_profile=...)``); without either the step time
is not compared, and the log says why. The peak memory is the device allocator's on GPUs
(``torch.cuda.max_memory_allocated`` over the measured steps) and on CPU ranks the most bytes of live tensors over
one step (`lit3d.strategies.telemetry.live_memory.LiveTensors`: what a GPU's allocator would hand out), the largest over
ranks.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lit3d.models.loop import ends_optimizer_step
from lit3d.planner.calibrate import cluster_of
from lit3d.planner.hardware import identify
from lit3d.planner.inputs import GB, PEAK_BAND, Cluster, Plan, Training
from lit3d.planner.run import RunningStrategy, data_says, fed_shape, plan_of_run
from lit3d.strategies.telemetry.held_memory import memory_line
from lit3d.strategies.telemetry.live_memory import PeakMemory

MEMORY_STEP = 1  # the fit's optimizer step (from 0) whose peak is measured on CPU: after the first, states exist
TIMED_STEPS = 3  # optimizer steps timed after it


def start_plan(strategy: RunningStrategy, trainer: L.Trainer) -> tuple[Plan | None, dict[str, int] | None]:
    """The planner's estimate of the strategy's run (`planned_run`) and of this rank's stage, which rank 0 logs, and
    the `PlanCheck` that holds the run to it added to ``trainer``'s callbacks (one per fit)."""
    plan, check = planned_run(strategy)
    if plan is None:
        return None, None
    estimate = plan.memory_by_stage[strategy.layout.coordinate(strategy.global_rank).p]
    rank_zero_info(memory_line(estimate))
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, PlanCheck)] + [check]
    return plan, estimate


def planned_run(strategy: RunningStrategy, fed: tuple[int, int] | None = None) -> tuple[Plan | None, PlanCheck | None]:
    """The planner's estimate of the strategy's run (a lit3d GPT's; else None), priced on this device where it can
    be, and the check that holds the run to it; ``fed``: the shape of the batches it is fed (`plan_of_run`)."""
    where = (strategy.root_device, strategy.num_nodes, strategy.num_processes, strategy.parallelism.plan_profile)
    cluster, priced_on = run_cluster(*where)
    plan = plan_of_run(strategy, cluster, fed)
    if plan is None:
        return None, None
    planned_step = plan.step_time_s if cluster is not None else None
    return plan, PlanCheck(plan, planned_step, priced_on, strategy.layout.grid, usable_memory(strategy))


def usable_memory(strategy: RunningStrategy) -> float | None:
    """The bytes a rank of this run may hold, less the planner's headroom: ``auto_memory_gb`` where given, else a GPU's
    memory; None on CPU ranks without a limit."""
    limit = strategy.parallelism.auto_memory_gb
    if limit is not None:
        limit *= GB
    elif strategy.root_device.type == "cuda":
        limit = torch.cuda.get_device_properties(strategy.root_device).total_memory
    return None if limit is None else limit * (1 - Training.headroom)


def run_cluster(device: torch.device, nodes: int, per_node: int, profile: str | None) -> tuple[Cluster | None, str]:
    """The cluster this run's step is priced on and what it is, or None and why not."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        gpu = identify(name)
        if gpu is None:
            return None, f"the planner does not know this GPU ({name})"
        return Cluster.of(gpu, nodes, per_node), name
    if profile is None:
        return None, "no profile of this CPU (lit3d calibrate, then Parallel3DStrategy(plan_profile=...))"
    return cluster_of(profile, per_node, nodes), f"the profile {profile}"


class PlanCheck(L.Callback):
    """Measures the peak memory of the fit's step `MEMORY_STEP` (on GPUs: from it on), times the `TIMED_STEPS`
    optimizer steps after it, and logs both against ``plan`` (``planned_step``: the plan's step time where it was
    priced on this device, else None, ``priced_on`` saying why) once: at the last timed step, or at the fit's last
    step if it comes first. A peak past the band or the ``usable`` bytes is warned, naming ``layout``.

    The plan made at the fit's start reads the batch from the data module, which a run fed by a plain ``DataLoader``
    or a module of the user's does not say: at the fit's first batch the run is planned again for the shape that
    batch has (`lit3d.planner.run.fed_shape`: a micro-step of this replica), and the check holds it to that plan,
    saying so (``fed``)."""

    def __init__(
        self, plan: Plan, planned_step: float | None, priced_on: str, layout: str, usable: float | None
    ) -> None:
        self.planned_peak = max(stage["total"] for stage in plan.memory_by_stage)
        self.planned_step, self.priced_on = planned_step, priced_on
        self.peak, self.first = PeakMemory(MEMORY_STEP, outer_state), 0
        self.layout, self.usable = layout, usable
        self.fed: str | None = None  # the shape planned for, once read from the first batch
        self.ratios: dict[str, float] = {}
        self._ends: list[float] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._ends, self.ratios = [], {}
        self.first = trainer.global_step  # (a resumed fit starts later)
        self.peak = PeakMemory(self.first + MEMORY_STEP, outer_state)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.fed is None:
            self._plan_fed(trainer, pl_module, batch)
        if pl_module.device.type != "cuda":
            self.peak.on_train_batch_start(trainer, pl_module, batch, batch_idx)
        elif trainer.global_step == self.first + MEMORY_STEP and not self._ends:
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def _plan_fed(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any) -> None:
        """The run planned again for the shape of ``batch``, the first it is fed (every rank: the strategy's plan,
        which `lit3d.callbacks.CommReport` reads, is replaced too)."""
        fed = fed_shape(pl_module, batch)
        self.fed = ""
        if fed is None:
            return
        strategy = trainer.strategy
        plan, check = planned_run(strategy, fed)
        if plan is None or check is None:
            return
        strategy.plan = plan
        strategy.memory_estimate = plan.memory_by_stage[strategy.layout.coordinate(strategy.global_rank).p]
        self.planned_peak, self.planned_step = check.planned_peak, check.planned_step
        self.fed = f"; planned for the batches fed: {fed[0]} x {fed[1]} tokens per replica and micro-step (the first's)"
        self.fed += data_says(strategy, fed)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self.peak.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        done = trainer.global_step - self.first  # optimizer steps of this fit
        if not ends_optimizer_step(trainer) or self.ratios or done <= MEMORY_STEP:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self._ends.append(time.perf_counter())
        if done >= MEMORY_STEP + 1 + TIMED_STEPS or trainer.global_step == trainer.max_steps:
            self._report(trainer, pl_module)

    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Every rank: the largest rank's peak (a collective); rank 0 logs and says the ratios."""
        device = pl_module.device
        local = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else self.peak.measured["peak"]
        peak = float(trainer.strategy.reduce(torch.tensor(float(local), device=device), reduce_op="max"))
        self.ratios["plan/peak_memory_ratio"] = peak / self.planned_peak
        intervals = [b - a for a, b in zip(self._ends, self._ends[1:])]
        step = statistics.median(intervals) if intervals else None
        if step is not None and self.planned_step:
            self.ratios["plan/step_time_ratio"] = step / self.planned_step
        if trainer.is_global_zero:  # once, at this step (a module's `log` would repeat it at every later step)
            for logger in trainer.loggers:
                logger.log_metrics(self.ratios, step=trainer.global_step)
        line = plan_check_line(peak, self.planned_peak, step, self.planned_step, self.priced_on)
        rank_zero_info(line + (self.fed or ""))
        overrun = overrun_warning(peak, self.planned_peak, self.usable, self.layout)
        if overrun is not None:
            rank_zero_warn(overrun)


def outer_state(trainer: L.Trainer) -> list[torch.Tensor]:
    """DiLoCo's anchor and outer momentum, held throughout training beside the inner optimizer's states."""
    steps = trainer.strategy.optimizer_steps
    loop = steps.outer_loop if steps is not None else None
    return loop.state_tensors() if loop is not None else []


def plan_check_line(peak: float, planned_peak: float, step: float | None, planned_step: float | None, why: str) -> str:
    """What rank 0 says of the plan check."""
    line = f"plan check: peak memory {peak / 2**30:.3f} GiB measured / {planned_peak / 2**30:.3f} GiB planned = "
    line += f"{peak / planned_peak:.2f}x (largest rank)"
    if step is None:
        return line + "; step time: too few steps to time"
    if planned_step is None:
        return line + f"; step time {step:.3f} s measured, not compared: {why}"
    return (
        line + f"; step time {step:.3f} s measured / {planned_step:.3f} s planned on {why} = {step / planned_step:.2f}x"
    )


def overrun_warning(peak: float, planned_peak: float, usable: float | None, layout: str) -> str | None:
    """What rank 0 warns once when the measured peak passes the band the suite holds runs to (`PEAK_BAND` times the
    plan) or the memory a rank may use; None when it keeps to both."""
    ratio = peak / planned_peak
    over = [f"{ratio:.2f}x its plan, above the {PEAK_BAND}x runs are held to"] if ratio > PEAK_BAND else []
    if usable is not None and peak > usable:
        over.append(f"{peak / GB:.3g} GB of the {usable / GB:.3g} GB a rank may use (less headroom)")
    if not over:
        return None
    return (
        f"{layout} peaked at {peak / GB:.3g} GB, " + " and ".join(over) + ": give the run more memory per rank, "
        "or split the model further (--trainer.strategy.activation_checkpointing=true, a larger zero_stage, ...)"
    )
