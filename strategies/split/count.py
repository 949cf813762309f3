"""What `lit3d plan --verify` sets beside the planner's counts: the strategy's own split of the real model, for one
rank, on the meta device, in a fake world.

The rank joins a fake process group of the full world size (PyTorch's testing backend: collectives return at once,
nothing is sent), builds the model on the meta device and runs `parallelize_network` on it; the parameter elements it
then holds locally are the exact count. No memory is allocated, so a thousand simulated ranks take seconds.

NOTE: the planner sits below the strategy, which asks it for plans, so it never imports this module: its caller hands
it `held_params` (``lit3d plan --verify`` does: `lit3d.planner.Request`'s ``verify``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from lit3d.models.config import GPTConfig
from lit3d.models.tp_plan import tensor_parallel_plan
from lit3d.models.transformer import Transformer
from lit3d.parallel.layout import Layout
from lit3d.parallel.settings import Parallelism
from lit3d.strategies.meshes import ParallelMeshes
from lit3d.strategies.parallelize import parallelize_network


def held_params(config: GPTConfig, layout: Layout, settings: Parallelism, rank: int) -> int:
    """The parameter elements ``rank`` holds after the real split of ``config`` on ``layout`` with ``settings`` (its
    sizes are ``layout``'s)."""
    if dist.is_initialized():
        raise RuntimeError("held_params() starts its own fake process group; call it outside a distributed job")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        meshes = ParallelMeshes.build(layout, "cpu")
        with torch.device("meta"):
            network = Transformer(config)
        parallelize_network(network, tensor_parallel_plan(config), settings, meshes, rank)
        return sum(_local(p).numel() for p in network.parameters())
    finally:
        dist.destroy_process_group()


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param
