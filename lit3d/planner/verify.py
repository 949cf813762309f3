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

from lit3d.config import GPTConfig
from lit3d.parallel.layout import Layout
from lit3d.parallel.schedules import SCHEDULES
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


def analytic_params(
    config: GPTConfig, layout: Layout, stage: int, zero_stage: int, virtual: int = 1, pipeline_schedule: str = "1f1b"
) -> int:
    """Parameter elements the planner expects on rank (d=0, t=0, p=stage)."""
    tensors = rank_tensors(config, layout.pp, virtual, stage, SCHEDULES[pipeline_schedule].placement)
    return sum(local_numel(t, layout.tp, replicas(t, layout) if zero_stage >= 2 else 1, ep=layout.ep) for t in tensors)


def verify(
    config: GPTConfig,
    layout: Layout,
    zero_stage: int,
    sequence_parallel: bool = False,
    virtual_pipeline_size: int = 1,
    activation_checkpointing: bool = False,
    pipeline_schedule: str = "1f1b",
) -> list[StageCount]:
    """Per pipeline stage: the parameter elements rank (d=0, t=0, p) holds after the real parallelisation."""
    # NOTE: torch only here: `lit3d plan` imports the planner, and only `--verify` needs the real model.
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lit3d.model import Transformer
    from lit3d.strategies.parallelize import parallelize_network
    from lit3d.tp_plan import tensor_parallel_plan

    if dist.is_initialized():
        raise RuntimeError("verify() starts its own fake process group; call it outside a distributed job")
    counts = []
    for stage in range(layout.pp):
        rank = layout.rank(d=0, t=0, p=stage)
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
        try:
            mesh = layout.build_mesh("cpu")
            expert_mesh = layout.build_expert_mesh("cpu") if layout.ep > 1 else None
            with torch.device("meta"):
                network = Transformer(config)
            parallelize_network(
                network,
                tensor_parallel_plan(config),
                layout,
                mesh,
                rank,
                zero_stage=zero_stage,
                sequence_parallel=sequence_parallel,
                virtual_pipeline_size=virtual_pipeline_size,
                pipeline_schedule=pipeline_schedule,
                activation_checkpointing=activation_checkpointing,
                expert_mesh=expert_mesh,
            )
            held = sum(_local(p).numel() for p in network.parameters())
        finally:
            dist.destroy_process_group()
        analytic = analytic_params(config, layout, stage, zero_stage, virtual_pipeline_size, pipeline_schedule)
        counts.append(StageCount(stage, rank, held, analytic))
    return counts


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param
