"""The next-token loss: cross-entropy in fp32 over targets that may be `IGNORED`, and over vocabulary-sharded logits
(tensor parallelism's head) with DTensor's parallel loss, which never gathers them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F


@contextmanager
def loss_parallel_scope() -> Iterator[None]:
    """DTensor's `loss_parallel`, entered only where it is not on already: a pipeline schedule computes the loss inside
    its step, and an inner `loss_parallel` would turn the outer one off as it left.

    NOTE: whether it is on is DTensor's own state (its table of custom operator handlers, which `loss_parallel` fills
    and empties: PyTorch 2.11 to 2.13), so lit3d keeps no copy of it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.distributed.tensor.parallel.loss import customized_loss_ops

    handlers = DTensor._op_dispatcher._custom_op_handlers
    with nullcontext() if all(op in handlers for op in customized_loss_ops) else loss_parallel():
        yield


IGNORED = -100  # a target no loss is taken on (a prompt token, padding)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; with ``scale``, the sum over the targets that are not ``IGNORED``
    times ``scale / targets.numel()`` instead (`lit3d.GPT.loss` says why).

    Logits sharded over the vocabulary (a DTensor from a vocabulary-parallel head) are reduced with
    DTensor's parallel loss, which never gathers the full logits; the caller's backward must then run
    under `loss_parallel_scope` too (the strategy does this).
    """
    count = targets.numel()
    logits, targets = logits.flatten(0, 1).float(), targets.flatten()
    reduction = "mean" if scale is None else "sum"
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(logits, DTensor):
        # The targets go in as a DTensor too: backward saves them, and must not mix plain and distributed tensors.
        targets = DTensor.from_local(targets, logits.device_mesh, [Replicate()] * logits.device_mesh.ndim)
        with loss_parallel_scope():
            loss = F.cross_entropy(logits, targets, ignore_index=IGNORED, reduction=reduction)
        loss = loss.to_local()
    else:
        loss = F.cross_entropy(logits, targets, ignore_index=IGNORED, reduction=reduction)
    return loss if scale is None else loss * (scale / count)


class AddToObjective(torch.autograd.Function):
    """The identity on ``output``; in backward, ``weight`` becomes the gradient of ``term``, as if ``weight × term``
    had been added to the loss: how a pipeline stage's terms join the objective that only the last stage's loss
    carries (an MoE layer's balance loss, multi-token prediction's loss)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, term: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        ctx.save_for_backward(term)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (term,) = ctx.saved_tensors
        return grad, torch.full_like(term, ctx.weight), None


def trained_share(batch: Any) -> torch.Tensor | float:
    """How much an evaluation batch's loss weighs in the mean: 1, or with a ``loss_scale`` (chat data) the share of its
    round's targets that are trained (1 / scale: 0 for a round without any), so the mean is over answer tokens."""
    if not isinstance(batch, dict) or "loss_scale" not in batch:
        return 1.0
    scale = batch["loss_scale"][0]
    return torch.where(scale > 0, 1 / scale.clamp(min=1e-12), torch.zeros_like(scale))
