"""The learning-rate schedule `lit3d.GPT` trains with: a linear warm-up, then a cosine decay to a floor."""

from __future__ import annotations

import math
from typing import Any


class WarmupCosine:
    """LR multiplier: linear warm-up from 0 to 1 over ``warmup_steps``, then cosine down to ``min_ratio`` at step
    ``decay_steps``, and ``min_ratio`` after it. A function of the step alone: `GPT` sets ``decay_steps`` to the
    current run's horizon, also when it resumes a run that had another."""

    def __init__(self, warmup_steps: int, decay_steps: int, min_ratio: float) -> None:
        self.warmup_steps, self.decay_steps, self.min_ratio = warmup_steps, decay_steps, min_ratio

    def __repr__(self) -> str:
        return f"warm-up over {self.warmup_steps} steps, cosine to {self.min_ratio} x at step {self.decay_steps}"

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_refusal(
    learning_rate: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    warmup_steps: int,
    decay_steps: int | None,
    min_lr_ratio: float,
) -> str | None:
    """Every optimizer and schedule argument of `lit3d.GPT` out of range, in one line (None when all are fine), so a
    bad value is refused when the model is built, before any rank starts, rather than by ``torch.optim`` in
    ``configure_optimizers`` on every rank."""
    wrong = [
        f"learning_rate={learning_rate} must be > 0" if not learning_rate > 0 else "",
        f"weight_decay={weight_decay} must be >= 0" if not weight_decay >= 0 else "",
        f"betas={tuple(betas)} must be two numbers in [0, 1)"
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas)
        else "",
        f"eps={eps} must be >= 0" if not eps >= 0 else "",
        f"warmup_steps={warmup_steps} must be >= 0" if warmup_steps < 0 else "",
        f"decay_steps={decay_steps} must be above warmup_steps={warmup_steps}"
        if decay_steps is not None and decay_steps <= warmup_steps
        else "",
        f"min_lr_ratio={min_lr_ratio} must lie in [0, 1]" if not 0 <= min_lr_ratio <= 1 else "",
    ]
    wrong = [w for w in wrong if w]
    return "; ".join(wrong) if wrong else None


def horizon_warning(warmup_steps: int, decay_steps: int | None, max_steps: int) -> str | None:
    """A run that ends before its warm-up does (``max_steps`` <= ``warmup_steps``, no ``decay_steps``) never trains at
    its learning rate: said once, not refused (a short smoke test of a long config is a fair thing to run)."""
    if decay_steps is None and 0 < max_steps <= warmup_steps:
        return (
            f"max_steps={max_steps} ends within warmup_steps={warmup_steps}: the learning rate never reaches "
            "learning_rate and the cosine decay never starts (lower --model.warmup_steps for a short run)"
        )
    return None


def follow_schedule(scheduler: Any, planned: WarmupCosine, source: str) -> str | None:
    """Set a `WarmupCosine` schedule restored from a checkpoint to ``planned`` (what this run is configured with,
    from its ``source``: ``decay_steps`` or ``max_steps``), and the optimizer's learning rates to what ``planned``
    gives the step about to run; returns what to say about it (None when nothing changed)."""
    restored = [f for f in getattr(scheduler, "lr_lambdas", []) if isinstance(f, WarmupCosine)]
    if all(vars(f) == vars(planned) for f in restored):
        return None  # a fresh run, or one resumed with the same horizon
    # NOTE: LambdaLR's state holds its multiplier's fields (`LambdaLR.state_dict`), so a checkpoint brings back
    # the horizon of the run that saved it; left so, a run continued further would sit at the old floor.
    step, old, groups = scheduler.last_epoch, WarmupCosine(**vars(restored[0])), scheduler.optimizer.param_groups
    old_lr = groups[0]["lr"]
    for multiplier in restored:
        vars(multiplier).update(vars(planned))
    for group, base_lr, multiplier in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * multiplier(step)
    scheduler._last_lr = [group["lr"] for group in groups]  # what `get_last_lr()` reports
    longer, shorter = planned.decay_steps > old.decay_steps, planned.decay_steps < old.decay_steps
    how = "stretched" if longer else "shortened" if shorter else "changed"
    return (
        f"learning-rate schedule {how} from {old.decay_steps} to {planned.decay_steps} steps (this run's "
        f"{source}): from step {step} it follows "
        f"{planned}, so the learning rate is {differing(groups[0]['lr'], old_lr)}; "
        f"set decay_steps={old.decay_steps} to keep the checkpoint's schedule"
    )


def differing(new: float, old: float) -> str:
    """``new, not old`` in as few digits as tell them apart (3 at least), or ``new`` alone where they are equal."""
    if new == old:
        return f"{new:.3g} (unchanged)"
    digits = next((d for d in range(3, 17) if f"{new:.{d}g}" != f"{old:.{d}g}"), 17)
    return f"{new:.{digits}g}, not {old:.{digits}g}"
