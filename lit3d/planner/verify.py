"""`lit3d plan --verify`: the planner's per-rank parameter counts beside the strategy's real split of the real model
(on the meta device, in a fake world: `lit3d.strategies.split.count`), one rank of each pipeline stage.

NOTE: the planner sits below the strategy, which asks it for plans (``3d_auto``, ``plan/*`` ratios), so it takes the
split from its caller (`Split`) and never imports the strategy; ``lit3d plan --verify`` hands it
`lit3d.strategies.split.count.held_params`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from lit3d.models.config import GPTConfig
from lit3d.parallel.layout import Layout
from lit3d.parallel.schedules import SCHEDULES
from lit3d.parallel.settings import Parallelism
from lit3d.parallel.zero import ZeroPolicy
from lit3d.planner.tensors import local_numel, rank_tensors, replicas


class Split(Protocol):
    """The strategy's real split, counted: the parameter elements ``rank`` holds after it
    (`lit3d.strategies.split.count.held_params`)."""

    def __call__(self, config: GPTConfig, layout: Layout, settings: Parallelism, rank: int) -> int: ...


@dataclass
class StageCount:
    stage: int
    rank: int
    verified: int  # parameter elements the parallelised model holds on ``rank``
    analytic: int  # the planner's count

    @property
    def matches(self) -> bool:
        return self.verified == self.analytic


def analytic_params(config: GPTConfig, layout: Layout, stage: int, settings: Parallelism) -> int:
    """Parameter elements the planner expects on rank (p=stage, d=0, t=0)."""
    virtual = settings.chunks_per_rank if layout.pp > 1 else 1
    placement = SCHEDULES[settings.pipeline_schedule].placement
    tensors = rank_tensors(config, layout.pp, virtual, stage, placement, layers=settings.pipeline_stage_layers)
    sharded = ZeroPolicy.of(settings, layout).sharded_over_replicas
    return sum(local_numel(t, layout.tp, replicas(t, layout) if sharded else 1, ep=layout.ep) for t in tensors)


def verify(config: GPTConfig, layout: Layout, settings: Parallelism, split: Split) -> list[StageCount]:
    """Per pipeline stage: the parameter elements rank (p, d=0, t=0) holds after ``split``, the strategy's real
    parallelisation of ``config`` on ``layout`` with ``settings``, beside the planner's count."""
    counts = []
    for stage in range(layout.pp):
        rank = layout.rank(p=stage)
        analytic = analytic_params(config, layout, stage, settings)
        counts.append(StageCount(stage, rank, split(config, layout, settings, rank), analytic))
    return counts
