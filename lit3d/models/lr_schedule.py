"""The learning-rate schedule `lit3d.GPT` trains with: a linear warm-up, then a cosine decay to a floor."""

from __future__ import annotations

import math


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
