"""How a module's network runs on this rank: lit3d's protocol between a module and the strategy that splits it.

A module the strategy splits (like `lit3d.GPT`) makes its loss in three parts,
``loss_fn(model(inputs), targets)`` with ``inputs, targets = inputs_and_targets(batch)``, and runs the network through
``self.runner``::

    def loss(self, batch):
        inputs, targets = self.inputs_and_targets(batch)
        return self.runner.loss(self.model, inputs, targets, self.loss_fn)

    def forward(self, tokens):
        return self.runner.forward(self.model, tokens)

The module starts with `WholeNetwork` (the plain calls), which is what runs under any other strategy. When this rank
holds only part of the network or of each sequence, `Parallel3DStrategy` gives the module another runner when it splits
it, once, before the first step: a pipeline schedule (`lit3d.strategies.pipelining.step.Pipeline`: the loss runs forward
and backward of every micro-batch, its ``loss_fn`` on the last stage) and, with context parallelism, `ContextShare`
around it (this rank's chunks of every sequence). The module never asks which axes run; it asks its runner.

A runner's loss also takes what the network reads of the batch besides the inputs, ``context``
(`lit3d.models.batch_context`: `lit3d.GPT`'s packed documents and LoRA dropout's rows), and hands the network the part
of it that goes with the inputs it runs, as ``model(inputs, context=...)`` (not at all when it holds nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import torch
import torch.nn as nn

from lit3d.models.batch_context import NO_CONTEXT, BatchContext
from lit3d.models.documents import Documents
from lit3d.models.ring_attention import shard_sequence

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Runner(Protocol):
    """What a runner offers a module (`WholeNetwork`, `ContextShare`, a pipeline)."""

    # Whether `loss` already added the MoE layers' balance term and multi-token prediction's loss (a pipeline adds them
    # in backward, stage by stage).
    adds_balance_loss: bool
    # Forward passes of the network per `loss` call (a pipeline's micro-batches).
    forwards_per_loss: int
    # What the MoE layers' balance term counts in this rank's objective, as its loss does: its replica's share of an
    # uneven global batch (`ReplicaShare`), else 1.
    balance_weight: float

    def loss(
        self, network: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, context: BatchContext = NO_CONTEXT
    ) -> torch.Tensor: ...

    def forward(self, network: nn.Module, inputs: Any) -> Any: ...


class WholeNetwork:
    """The whole network on this rank: ``loss_fn(network(inputs, context=context), targets)``."""

    adds_balance_loss = False
    forwards_per_loss = 1
    balance_weight = 1.0

    def loss(
        self, network: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, context: BatchContext = NO_CONTEXT
    ) -> torch.Tensor:
        return loss_fn(network(inputs, **context.keywords()), targets)

    def forward(self, network: nn.Module, inputs: Any) -> Any:
        return network(inputs)


class ContextShare:
    """Context parallelism: this rank keeps its two of ``2 x size`` chunks of every sequence of the inputs and targets
    (`lit3d.models.ring_attention.shard_sequence`), of their packed documents and of multi-token prediction's tokens
    ahead, then runs ``inner`` on them. Each rank's loss is the mean over its tokens and every rank holds as many, so
    the mean over ranks is the mean over all tokens."""

    def __init__(self, inner: Runner, size: int, rank: int) -> None:
        self.inner, self.size, self.rank = inner, size, rank
        self.adds_balance_loss, self.forwards_per_loss = inner.adds_balance_loss, inner.forwards_per_loss
        self.balance_weight = inner.balance_weight

    def loss(
        self, network: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, context: BatchContext = NO_CONTEXT
    ) -> torch.Tensor:
        whole = context.documents_for(*targets.shape)
        inputs, targets = shard_sequence(inputs, self.size, self.rank), shard_sequence(targets, self.size, self.rank)
        if whole is not None:  # packed rows: this rank's tokens' positions and documents, and every rank's documents
            share = (shard_sequence(t, self.size, self.rank) for t in (whole.positions, whole.segments))
            context = replace(context, documents=Documents(*share, whole_segments=whole.segments))
        ahead = context.ahead
        if ahead is not None:  # made from the whole rows: cut as the inputs are (the scales are per row and depth)
            tokens, predicted = (shard_sequence(t, self.size, self.rank) for t in (ahead.tokens, ahead.targets))
            context = replace(context, ahead=replace(ahead, tokens=tokens, targets=predicted))
        return self.inner.loss(network, inputs, targets, loss_fn, context)

    def forward(self, network: nn.Module, inputs: Any) -> Any:
        raise RuntimeError(
            f"context_parallel_size={self.size} holds a share of every sequence; whole-sequence outputs (prediction, "
            "sampling) need context_parallel_size=1 (a checkpoint loads in any layout)"
        )


class ReplicaShare:
    """Uneven data parallelism (`data_parallel_shares`): this replica computes ``weight`` times an even share of each
    global batch, so its training loss counts ``weight`` times in the replicas' average (what data parallelism
    reduces), which is then the mean over the global batch; so does its MoE balance term (``balance_weight``: the module
    weighs the term it adds, and a pipeline, which adds it in backward, is built with the same weight). Evaluation
    deals even rounds and is not weighted.

    NOTE: training is told from evaluation by autograd being on: Lightning runs evaluation without it, and a
    pipeline's schedule calls the loss inside its training step only."""

    def __init__(self, inner: Runner, weight: float) -> None:
        self.inner, self.weight = inner, weight
        self.adds_balance_loss, self.forwards_per_loss = inner.adds_balance_loss, inner.forwards_per_loss
        self.balance_weight = weight

    def loss(
        self, network: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, context: BatchContext = NO_CONTEXT
    ) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.inner.loss(network, inputs, targets, loss_fn, context)

        def weighted(*args: Any, **kwargs: Any) -> torch.Tensor:
            return loss_fn(*args, **kwargs) * self.weight

        return self.inner.loss(network, inputs, targets, weighted, context)

    def forward(self, network: nn.Module, inputs: Any) -> Any:
        return self.inner.forward(network, inputs)
