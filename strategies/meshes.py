"""`ParallelMeshes`: the device meshes and process groups of one run, built once from its `Layout`.

Every rank builds the same object in ``setup_environment`` (each mesh and group creation is a collective), and
everything that communicates takes its groups from it: the split of the network (`parallelize_network`), the
optimizer steps, the checkpoints, DiLoCo's outer loop, `lit3d.CommReport` and the rank map. The arithmetic of which
ranks form a group is the layout's (`lit3d.parallel.layout`); here those groups become torch objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from lit3d.parallel.layout import LIGHTNING_DIM_NAMES, MESH_DIMS, Layout


class LightningNamedMesh(DeviceMesh):
    """A device mesh whose ``mesh[name]`` also takes Lightning's dim names (``"data_parallel"`` is ``"dp"``), so a
    module written for Lightning's ``ModelParallelStrategy`` runs unchanged."""

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str):
            return super().__getitem__(LIGHTNING_DIM_NAMES.get(names, names))
        return super().__getitem__(tuple(LIGHTNING_DIM_NAMES.get(name, name) for name in names))


@dataclass(frozen=True)
class ParallelMeshes:
    """The meshes and groups of a run.

    Attributes:
        layout: The sizes and rank arithmetic they were built from.
        world: ``(pp, dp, cp, tp)`` over every rank (``(island, pp, dp, cp, tp)`` with DiLoCo's islands): the
            strategy's ``device_mesh``.
        replicas: ``(pp, dp, tp)``, or ``(pp, dp_cp, tp)`` with context parallelism: its `replica_dim` spans the
            ranks that hold the same weights, what the weights are split, synced and ZeRO-sharded over (``world``'s
            own dims without context parallelism, a mesh of its own with it).
        sharding: What tensor parallelism and ZeRO split over: ``replicas``, or with HSDP's shard groups
            ``(pp, dp_replicate, dp_shard, tp)`` (``dp_shard`` spans a group's ``shard_size × cp`` ranks).
        experts: ``(pp, edp, ep, tp)`` with expert parallelism: ``ep`` splits each MoE layer's experts, ``edp`` holds
            the same ones.
        cp_group: The ring attention's group (context parallelism).
        ep_group: The group MoE layers dispatch their tokens over (expert parallelism).
        for_modules: What a module sees as ``self.device_mesh``: with data and tensor parallelism only, the very mesh
            of Lightning's ``ModelParallelStrategy`` (``("data_parallel", "tensor_parallel")``, over ``world``'s
            groups: no new ones); else ``world`` (which answers Lightning's names too).
    """

    layout: Layout
    world: DeviceMesh
    replicas: DeviceMesh
    sharding: DeviceMesh | None = None
    experts: DeviceMesh | None = None
    cp_group: Any = None
    ep_group: Any = None
    for_modules: DeviceMesh | None = None

    @classmethod
    def build(cls, layout: Layout, device_type: str) -> ParallelMeshes:
        """Every rank calls this, in the same order (each group is a collective)."""
        shape, names = (layout.pp, layout.dp, layout.cp, layout.tp), MESH_DIMS
        if layout.islands > 1:  # NOTE: the other dims then name one island's ranks (its own sub-mesh)
            shape, names = (layout.islands, *shape), ("island", *names)
        world = LightningNamedMesh(device_type, torch.arange(layout.world_size).view(shape), mesh_dim_names=names)
        replicas = world["pp", "dp", "tp"]
        if layout.cp > 1:  # the dp x cp ranks as one dim: a mesh of its own
            shape, names = (layout.pp, layout.replicas, layout.tp), ("pp", replica_dim(layout), "tp")
            replicas = DeviceMesh(device_type, torch.arange(layout.world_size).view(shape), mesh_dim_names=names)
        # NOTE: the ring and the tokens' all-to-alls get groups of their own, apart from the meshes' (which may be the
        # very group the weights sync over: dp == 1, or ep == dp), so that `CommReport` tells their bytes apart.
        cp_group = _subgroup(layout.cp_groups()) if layout.cp > 1 else None
        experts = _expert_mesh(layout, device_type) if layout.ep > 1 else None
        ep_group = _subgroup(layout.ep_groups()) if layout.ep > 1 else None
        lightning_like = layout.pp == layout.cp == layout.islands == 1
        for_modules = _lightning_mesh(world, layout) if lightning_like else world
        sharding = _shard_groups(layout, device_type) if layout.dp_replicate > 1 else replicas
        return cls(layout, world, replicas, sharding, experts, cp_group, ep_group, for_modules)

    def __post_init__(self) -> None:
        if self.sharding is None:  # (built by hand, as some tests do: no shard groups)
            object.__setattr__(self, "sharding", self.replicas)

    @property
    def replica_mesh(self) -> DeviceMesh:
        """The 1-D mesh of this rank's replicas (`replica_dim` of `replicas`): what the weights sync over."""
        return self.replicas[replica_dim(self.layout)]

    @property
    def zero_mesh(self) -> DeviceMesh:
        """What ZeRO shards over: `replica_mesh`, or with HSDP's shard groups the 2-D ``(dp_replicate, dp_shard)``
        (FSDP2 shards over the second and replicates over the first)."""
        if self.layout.dp_replicate > 1:
            return self.sharding["dp_replicate", "dp_shard"]
        return self.sharding[replica_dim(self.layout)]

    def group(self, axis: str) -> Any:
        """The process group of this rank along ``axis`` (``pp``, ``dp``, ``tp``, ``cp``, ``ep``, ``island``), or
        None when that axis has one rank. ``dp`` is the ``dp × cp`` replicas the weights are synced over."""
        if axis == "cp":
            return self.cp_group
        if axis == "ep":
            return self.ep_group
        mesh = self.replica_mesh if axis == "dp" else self.world[axis] if axis in self.world.mesh_dim_names else None
        return None if mesh is None or mesh.size() == 1 else mesh.get_group()


def replica_dim(layout: Layout) -> str:
    """The name of the replicas' dim: ``"dp"``, or ``"dp_cp"`` where it spans the ``dp × cp`` ranks."""
    return "dp_cp" if layout.cp > 1 else "dp"


def _shard_groups(layout: Layout, device_type: str) -> DeviceMesh:
    """HSDP's ``(pp, dp_replicate, dp_shard, tp)`` over the same ranks (``(island, ...)`` with DiLoCo's islands). With
    ``d = r · shard_size + s`` the rank formula's digits regroup as ``(p, r, (s, c), t)``: a shard group is the ``s``
    and ``c`` digits, consecutive ranks ``tp`` apart."""
    shape = (layout.pp, layout.dp_replicate, layout.shard_ranks, layout.tp)
    names = ("pp", "dp_replicate", "dp_shard", "tp")
    if layout.islands > 1:
        shape, names = (layout.islands, *shape), ("island", *names)
    return DeviceMesh(device_type, torch.arange(layout.world_size).view(shape), mesh_dim_names=names)


def _lightning_mesh(world: DeviceMesh, layout: Layout) -> DeviceMesh:
    """``ModelParallelStrategy``'s ``(data_parallel, tensor_parallel)`` mesh, of ``world``'s own dp and tp groups."""
    grid = torch.arange(layout.world_size).view(layout.dp, layout.tp)
    groups = [world["dp"].get_group(), world["tp"].get_group()]
    return DeviceMesh.from_group(groups, world.device_type, grid, mesh_dim_names=("data_parallel", "tensor_parallel"))


def _subgroup(groups: list[list[int]]) -> Any:
    mine, _ = torch.distributed.new_subgroups_by_enumeration(groups)
    return mine


def _expert_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """``(pp, edp, ep, tp)`` over the same ranks: ``dp = edp × ep``, each group of ``ep`` consecutive DP ranks
    splitting the experts and the ranks that hold the same ones along ``edp`` (the other such groups, times the CP
    ranks: ``edp`` is ``dp / ep × cp`` ranks)."""
    pp, dp, ep, cp, tp = layout.pp, layout.dp, layout.ep, layout.cp, layout.tp
    # rank = t + c·T + d·T·C + p·T·C·D with d = g·ep + e: regroup the digits as (p, (g, c), e, t)
    ranks = torch.arange(layout.world_size).view(pp, dp // ep, ep, cp, tp)
    ranks = ranks.permute(0, 1, 3, 2, 4).reshape(pp, dp // ep * cp, ep, tp)
    return DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "edp", "ep", "tp"))
