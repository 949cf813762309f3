"""Pipeline parallelism: this rank's stages (see `lit3d.strategies.pipelining.chunks`) run by
`torch.distributed.pipelining`.

One training step runs the schedule's forward and backward over ``num_microbatches`` micro-batches, with the
module's own loss function computed on the last stage; the loss is broadcast to every rank of the pipeline, so
all ranks log the same value. With ``virtual > 1`` a rank holds ``virtual`` chunks that are not adjacent, for
the interleaved and V-shaped schedules (which schedule is which, and its theory: `lit3d.parallel.schedules`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from functools import cache
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_leaves

from lit3d.models.batch_context import NO_CONTEXT, BatchContext
from lit3d.models.loss import loss_parallel_scope
from lit3d.parallel.schedules import SCHEDULES, Costs, bubble_theory
from lit3d.parallel.stages import stage_rank
from lit3d.strategies.pipelining.timeline import PipelineTimeline
from lit3d.strategies.torch_compat import all_gather_single, pipeline_stage

# What a module split by the strategy provides so that its loss can run as a schedule: `loss(batch)` is
# `loss_fn(model(inputs), targets)` with `inputs, targets = inputs_and_targets(batch)`.
PIPELINE_PROTOCOL = ("inputs_and_targets", "loss_fn", "loss")


def check_pipeline_protocol(module: Any, pp: int) -> None:
    """Refuse a module whose loss cannot run as a pipeline schedule, naming what it lacks."""
    missing = [name for name in PIPELINE_PROTOCOL if not callable(getattr(module, name, None))]
    if missing:
        raise TypeError(
            f"pipeline_parallel_size={pp} runs {type(module).__name__}'s loss as a pipeline schedule, which needs "
            f"{', '.join(PIPELINE_PROTOCOL)}; it lacks {', '.join(missing)}"
        )


class Pipeline:
    """This rank's stages and the schedule that runs them.

    Args:
        chunks: This rank's chunk views, in global stage order.
        stage_ids: Their global stage indices.
        num_stages: ``pp × virtual``.
        pp_mesh: The 1-D pipeline mesh of this rank.
        schedule: A name of `lit3d.parallel.schedules.SCHEDULES` (``1f1b``, ``zbv``, ...).
        microbatches: Micro-batches per step.
        device: Where the stages compute.
        loss_parallel: Whether the last stage's logits are vocabulary-parallel DTensors.
        split_backward: Whether the zero-bubble schedules run the weight gradient apart from the input gradient
            (``False`` under activation checkpointing: see `_stages`).
        accumulate: Lightning's micro-steps per optimizer step, asked at each step (the loss is divided by them).
        first_micro_step: Whether this training step is the first of its optimizer step, asked at each step: the
            gradients the parameters hold then are the last optimizer step's, which Lightning zeroes after it.
        grad_scaler: fp16's loss scaler, asked at each step (its scale multiplies the loss inside the schedule, whose
            backward is the only one; the precision plugin unscales the gradients before the optimizer step).
        balance_weight: What the MoE layers' balance term counts, as the loss does (an uneven replica's share:
            `lit3d.models.runner.ReplicaShare`, which weighs the loss around this runner).

    It is a module's runner (`lit3d.models.runner`): the module's ``loss`` and ``forward`` call `loss` and `forward`.
    """

    adds_balance_loss = True  # every stage's MoE layers add their term in backward (the context's objective_weight)

    def __init__(
        self,
        chunks: list[nn.Module],
        stage_ids: list[int],
        num_stages: int,
        pp_mesh: DeviceMesh,
        schedule: str,
        microbatches: int,
        device: torch.device,
        loss_parallel: bool,
        split_backward: bool = True,
        accumulate: Callable[[], int] = lambda: 1,
        first_micro_step: Callable[[], bool] = lambda: True,
        grad_scaler: Callable[[], Any] = lambda: None,
        balance_weight: float = 1.0,
    ) -> None:
        self.chunks, self.stage_ids, self.num_stages = chunks, stage_ids, num_stages
        self.split_backward = split_backward
        self.pp_mesh, self.group = pp_mesh, pp_mesh.get_group()
        self.schedule_name, self.microbatches, self.device = schedule, microbatches, device
        self.loss_parallel = loss_parallel
        self.accumulate, self.first_micro_step, self.grad_scaler = accumulate, first_micro_step, grad_scaler
        self.balance_weight = balance_weight
        self.holds_first, self.holds_last = 0 in stage_ids, num_stages - 1 in stage_ids
        last = stage_rank(num_stages - 1, pp_mesh.size(), SCHEDULES[schedule].placement)  # rank 0 under a V
        self.last_rank = dist.get_global_rank(self.group, last)
        self.clock = StageClock(device)
        self._loss_fn: Callable | None = None
        self._losses: list[torch.Tensor] = []
        self._scale = 1.0
        self._grad_scaler: Any = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.schedule = self._schedule(self._stages(self.clock), schedule, microbatches, self._record_loss)
        self._inference: dict[tuple, Any] = {}

    def _stages(self, clock: StageClock | None) -> list[Any]:
        # NOTE: PyTorch's checkpoint recomputes a block once per backward call, and its contexts serve one
        # recomputation: a weight gradient run apart from its input gradient would recompute again and fail. Under
        # activation checkpointing a zero-bubble schedule therefore runs each whole backward in its input-gradient
        # slot (a `dw_builder` whose weight step is empty): the same order and gradients, the weight gradients no
        # longer filling the bubbles (`lit3d.parallel.schedules.Costs.of`).
        whole = None if self.split_backward else (lambda: _nothing)
        return [
            _stage_class()(
                chunk,
                s,
                self.num_stages,
                self.device,
                group=self.group,
                dw_builder=whole,
                clock=clock,
            )
            for chunk, s in zip(self.chunks, self.stage_ids)
        ]

    @staticmethod
    def _schedule(stages: list[Any], name: str, microbatches: int, loss_fn: Callable | None) -> Any:
        import torch.distributed.pipelining as pipelining

        schedule = SCHEDULES[name]
        # NOTE: scale_grads=False: the loss function divides by the micro-batch count itself, because the
        # schedule's own scaling would also shrink gradients accumulated over earlier Lightning micro-steps.
        return getattr(pipelining, schedule.torch_class)(
            stages if schedule.chunks != 1 else stages[0],
            n_microbatches=microbatches,
            loss_fn=loss_fn,
            scale_grads=False,
        )

    def _record_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self._loss_fn(output, target)
        self._losses.append(loss.detach())
        loss = loss * self._scale
        return self._grad_scaler.scale(loss) if self._grad_scaler is not None else loss

    @property
    def forwards_per_loss(self) -> int:
        return self.microbatches

    def loss(
        self,
        network: nn.Module | None,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: Callable,
        context: BatchContext = NO_CONTEXT,
    ) -> torch.Tensor:
        """Forward (and, with gradients enabled, backward) of one batch through the whole pipeline (``network``:
        the module's, of which this rank runs its chunks). Each stage call is handed its micro-batch's rows of
        ``context`` (`lit3d.models.batch_context`).

        Returns the mean loss over the micro-batches on every rank of the pipeline. Gradients accumulate as if
        ``loss / accumulate`` had been back-propagated through the unsplit model, multiplied by the loss scale of
        ``grad_scaler`` (fp16's `torch.amp.GradScaler`, which unscales them before the optimizer step) if given.
        """
        accumulate, grad_scaler = self.accumulate(), self.grad_scaler()
        if inputs.shape[0] % self.microbatches:
            raise ValueError(
                f"a batch of {inputs.shape[0]} sequences cannot be split into num_microbatches="
                f"{self.microbatches}; make the per-replica batch a multiple of it"
            )
        self._loss_fn, self._losses, self._grad_scaler = loss_fn, [], grad_scaler
        self._scale = 1.0 / (self.microbatches * accumulate)
        # NOTE: contiguous, since a stage checks its inputs' strides against those it traced (PyTorch 2.11/2.12), and
        # inputs sliced from longer blocks (``tokens[:, :-1]``) keep the longer rows' stride.
        args = (inputs.contiguous(),) if self.holds_first else ()
        target = targets if self.holds_last else None
        # NOTE: a keyword argument, which the schedule splits into micro-batches as it splits the inputs (each tensor
        # by rows) and hands every stage, first or not, for each micro-batch it runs (and its shape inference, the
        # first's); a block recomputed in backward runs with the arguments of its forward.
        self.clock.start_step()
        # NOTE: return_outputs=False: the losses are recorded by `_record_loss`, and the last stage would otherwise
        # keep every micro-batch's logits (its outputs) until the step's end, where the schedule frees each one after
        # its backward.
        with loss_parallel_scope() if self.loss_parallel else nullcontext():
            if torch.is_grad_enabled():
                scale = self._scale * (grad_scaler.get_scale() if grad_scaler is not None else 1.0)
                scale *= self.balance_weight  # (an uneven replica's share, as its loss)
                kwargs = replace(context, objective_weight=scale).keywords()  # MoE layers on every stage
                with self._gradients_set_aside():
                    self.schedule.step(*args, target=target, return_outputs=False, **kwargs)
            else:  # validation: forward only, and not in inference mode (the stages' buffers outlive this call)
                with torch.inference_mode(False):
                    self.schedule.eval(*args, target=target, return_outputs=False, **context.keywords())
        self.clock.end_step()
        # NOTE: the first step also calls the loss on placeholder outputs to infer shapes: keep the last m.
        losses = self._losses[-self.microbatches :]
        mean = torch.stack(losses).mean() if self.holds_last else torch.zeros((), device=self.device)
        dist.broadcast(mean, src=self.last_rank, group=self.group)
        return mean

    def clocked_step(self, module: Any, parallelism: Any, step: Callable[[], Any]) -> Any:
        """Lightning's training step (``step``), with the stage clock on for the steps Lightning logs or a timeline
        draws, and on the former each stage's busy time and the measured bubble logged next to the theory.

        NOTE: only on those steps: the clock's metrics cost a collective and a host sync."""

        trainer = module.trainer
        logs = trainer._logger_connector.should_update_logs
        timelines = [cb for cb in trainer.callbacks if isinstance(cb, PipelineTimeline)]
        self.clock.enabled = logs or any(cb.wants(trainer) for cb in timelines)
        output = step()
        if logs:
            costs = Costs.of(parallelism.activation_checkpointing)
            theory = bubble_theory(self.schedule_name, self.pp_mesh.size(), self.microbatches, len(self.chunks), costs)
            for name, value in {**self.activity(), "pp/bubble_theory": theory}.items():
                module.log(name, value, on_step=True, rank_zero_only=True, batch_size=1)
        return output

    def activity(self) -> dict[str, float]:
        """The last step as every rank of the pipeline saw it: each stage's busy seconds, the step's seconds, and
        the measured bubble (the mean idle share of the step). Every rank of the pipeline calls this."""
        mine = torch.tensor([self.clock.busy(), self.clock.step_seconds()], device=self.device)
        every = torch.empty(self.pp_mesh.size() * 2, device=self.device)
        all_gather_single(every, mine, group=self.group)
        busy, step = every.view(-1, 2).unbind(1)
        metrics = {f"pp/stage{p}_busy_s": seconds for p, seconds in enumerate(busy.tolist())}
        return {**metrics, "pp/step_s": step.max().item(), "pp/bubble": 1 - (busy / step.max()).mean().item()}

    @contextmanager
    def _gradients_set_aside(self) -> Iterator[None]:
        """Keep the step's gradients apart until `accumulate_gradients` (the strategy's backward).

        NOTE: Lightning zeroes gradients between ``training_step`` and ``backward``; the schedule runs backward
        inside the training step, so its gradients wait aside and join the others when Lightning's backward
        comes, exactly as if it had computed them then. On the first micro-step of an optimizer step the gradients
        held are the last step's, which that zeroing drops: they are dropped now, so that the schedule does not run
        beside a second copy of every gradient.
        """
        params = list({id(p): p for chunk in self.chunks for p in chunk.parameters()}.values())
        earlier = [None] * len(params) if self.first_micro_step() else [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
        finally:
            self._pending = [(p, _like_param(p.grad, p)) for p in params]
            for p, grad in zip(params, earlier):
                p.grad = grad

    @torch.no_grad()
    def accumulate_gradients(self) -> None:
        """Add the gradients of the last training step (see `_gradients_set_aside`) to the parameters'."""
        for p, grad in self._pending:
            if grad is not None:
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad += grad
        self._pending = []

    @torch.no_grad()
    def forward(self, network: nn.Module | None, inputs: torch.Tensor) -> torch.Tensor:
        """The last stage's whole output (e.g. logits ``[batch, seq, vocab]``) on every rank: for sampling and
        prediction, one micro-batch, forward only.

        The sequence (dim 1) is padded on the right to a multiple of 64, which changes nothing before it in a
        causal model, because a stage learns its buffer shapes once: one schedule per padded shape.
        """
        seq = inputs.shape[1]
        padded = -(-seq // 64) * 64
        inputs = torch.nn.functional.pad(inputs, (0, padded - seq))
        with torch.inference_mode(False):
            key = tuple(inputs.shape)
            if key not in self._inference:
                name = SCHEDULES[self.schedule_name].forward_only or self.schedule_name
                self._inference[key] = self._schedule(self._stages(None), name, 1, None)
            output = self._inference[key].eval(*((inputs,) if self.holds_first else ()))
            if self.holds_last:
                output = output.full_tensor() if hasattr(output, "full_tensor") else output
                output = output.contiguous()
            shape = [(output.shape, output.dtype) if self.holds_last else None]
            dist.broadcast_object_list(shape, src=self.last_rank, group=self.group)
            if not self.holds_last:
                output = torch.empty(shape[0][0], dtype=shape[0][1], device=self.device)
            dist.broadcast(output, src=self.last_rank, group=self.group)
        return output[:, :seq]


def _nothing() -> None:
    """The weight step of a backward that already ran whole."""


@cache
def _stage_class() -> type:
    """PyTorch's `PipelineStage`, timed by a `StageClock` and mended for forward-only runs (imported late: the module
    takes seconds to import: `torch_compat.pipeline_stage`)."""

    class Stage(pipeline_stage()):
        """NOTE: the V-shaped schedules hold two adjacent stages on one rank and hand a backward's input gradient
        from one to the other directly; PyTorch 2.13 does so in ``eval()`` too (validation, sampling), where there is
        no backward, and fails. Nothing is handed over then. PyTorch 2.11 keeps the batch's context (a keyword input)
        whole among the inputs backward differentiates, and fails on it: they are its tensors here, as 2.13 keeps."""

        def __init__(self, *args: Any, clock: StageClock | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.clock = clock  # times each call when given (`StageClock`)

        def forward_one_chunk(self, chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            output = self._timed("F", chunk_id, super().forward_one_chunk, *args, **kwargs)
            if chunk_id in (cache := getattr(self, "fwd_cache", {})):  # (to 2.13: what backward differentiates)
                kept, inputs = cache[chunk_id]
                cache[chunk_id] = kept, [x for x in tree_leaves(inputs) if isinstance(x, torch.Tensor)]
            return output

        def backward_one_chunk(self, chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            return self._timed("B", chunk_id, super().backward_one_chunk, *args, **kwargs)

        def backward_weight_one_chunk(self, chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            return self._timed("W", chunk_id, super().backward_weight_one_chunk, *args, **kwargs)

        def _timed(self, kind: str, chunk_id: int, run: Callable, *args: Any, **kwargs: Any) -> Any:
            if self.clock is None:
                return run(chunk_id, *args, **kwargs)
            return self.clock.timed(self.stage_index, kind, chunk_id, run, *args, **kwargs)

        def get_local_bwd_output(self, mb_index: int) -> tuple:
            return super().get_local_bwd_output(mb_index) if self.has_backward else ()

        def set_local_bwd_input(self, next_stage_bwd_outputs: tuple, mb_index: int) -> None:
            if self.has_backward:
                super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    return Stage


def _like_param(grad: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor | None:
    """A DTensor gradient in its parameter's layout (see `tensor_parallel.lay_out_grads_like_params`)."""
    placements = getattr(param, "placements", None)
    if grad is not None and placements is not None and grad.placements != placements:
        return grad.redistribute(placements=placements)
    return grad


class StageClock:
    """Times every forward, backward and weight-gradient call of the stages (CUDA events on GPUs: no syncs).

    After a step, `timeline()` gives ``(stage, kind, micro-batch, start, end)`` in seconds from the step start,
    `busy()` the time spent computing and `step_seconds()` the step's duration.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.enabled = False  # set for the steps someone reads (logged metrics, a timeline): no events otherwise
        self._marks: list[tuple[int, str, int, Any, Any]] = []
        self._start = self._end = None

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1000 if self.cuda else b - a

    def timed(self, stage: int, kind: str, chunk_id: int, run: Callable, *args: Any, **kwargs: Any) -> Any:
        """``run(chunk_id, ...)``, recorded as ``(stage, kind, chunk_id, start, end)`` when enabled."""
        if not self.enabled:
            return run(chunk_id, *args, **kwargs)
        start = self._mark()
        try:
            return run(chunk_id, *args, **kwargs)
        finally:
            self._marks.append((stage, kind, chunk_id, start, self._mark()))

    def start_step(self) -> None:
        self._marks, self._start = [], self._mark() if self.enabled else None

    def end_step(self) -> None:
        self._end = self._mark() if self.enabled else None

    def timeline(self) -> list[tuple[int, str, int, float, float]]:
        if self.cuda:
            torch.cuda.synchronize()
        return [
            (s, k, mb, self._seconds(self._start, a), self._seconds(self._start, b)) for s, k, mb, a, b in self._marks
        ]

    def busy(self) -> float:
        return sum(end - start for *_, start, end in self.timeline())

    def step_seconds(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return self._seconds(self._start, self._end)
