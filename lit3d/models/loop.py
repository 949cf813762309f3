"""Questions about Lightning's training loop, answered in one place for the model and the callbacks."""

from __future__ import annotations

import lightning as L


def ends_optimizer_step(trainer: L.Trainer) -> bool:
    """Whether the training batch now running (or just run) is the last of its accumulation window, so an optimizer
    step follows: every ``accumulate_grad_batches``-th batch, and the last batch of an epoch (a shorter window).

    NOTE: this asks the fit loop itself, so the answer is always the loop's, also on a resumed run and for a
    strategy that accumulates on its own.
    """
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def starts_optimizer_step(trainer: L.Trainer) -> bool:
    """Whether the training batch now running is the first of its accumulation window: where Lightning's automatic
    optimization zeroes the gradients after the training step (``batch_idx % accumulate_grad_batches == 0``)."""
    return trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0
