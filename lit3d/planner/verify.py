"""`lit3d plan --verify`: the real parallelisation of the real model, on the meta device, in a fake world.

For each pipeline stage, one rank of that stage (data-parallel and tensor-parallel coordinate 0) joins a fake
process group of the full world size (PyTorch's testing backend: collectives return at once, nothing is
sent), builds the model on the meta device and runs the strategy's own `parallelize_network` on it. The
parameter elements it then holds locally are the exact per-rank counts, set next to the planner's analytic
ones. No memory is allocated, so a thousand simulated ranks take seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lit3d.models.config import GPTConfig
from lit3d.models.tp_plan import tensor_parallel_plan
from lit3d.parallel.layout import Layout
from lit3d.parallel.schedules import SCHEDULES
from lit3d.parallel.settings import Parallelism
from lit3d.parallel.zero import ZeroPolicy
from lit3d.planner.tensors import local_numel, rank_tensors, replicas

if TYPE_CHECKING:
    import torch


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


def verify(config: GPTConfig, layout: Layout, settings: Parallelism) -> list[StageCount]:
    """Per pipeline stage: the parameter elements rank (p, d=0, t=0) holds after the real parallelisation of
    ``config`` on ``layout`` with ``settings`` (its sizes are ``layout``'s)."""
    # NOTE: torch only here: `lit3d plan` imports the planner, and only `--verify` needs the real model.
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lit3d.models.transformer import Transformer
    from lit3d.strategies.meshes import ParallelMeshes
    from lit3d.strategies.parallelize import parallelize_network

    if dist.is_initialized():
        raise RuntimeError("verify() starts its own fake process group; call it outside a distributed job")
    counts = []
    for stage in range(layout.pp):
        rank = layout.rank(p=stage)
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
        try:
            meshes = ParallelMeshes.build(layout, "cpu")
            with torch.device("meta"):
                network = Transformer(config)
            parallelize_network(network, tensor_parallel_plan(config), settings, meshes, rank)
            held = sum(_local(p).numel() for p in network.parameters())
        finally:
            dist.destroy_process_group()
        analytic = analytic_params(config, layout, stage, settings)
        counts.append(StageCount(stage, rank, held, analytic))
    return counts


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param
