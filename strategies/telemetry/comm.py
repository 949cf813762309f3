"""Bytes each rank sends, per mesh axis, measured under PyTorch's `CommDebugMode`.

`CommDebugMode` counts collectives (those of DTensor, FSDP2 and plain ``torch.distributed``); `CommBytes`
also weighs each one. A rank's bytes for one collective are what a ring algorithm makes it send, the
convention of the planner (`lit3d.planner.estimate`):

    all-reduce        2 (n-1)/n × tensor
    all-gather          (n-1)/n × gathered tensor
    reduce-scatter      (n-1)/n × input tensor
    all-to-all          (n-1)/n × input tensor; with split sizes, the parts for the other ranks
    send                          tensor (point to point, between pipeline stages)

``n`` is the size of the collective's process group, which also names its axis (`by_axis`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from lit3d.strategies.meshes import ParallelMeshes

c10d, funcol = torch.ops.c10d, torch.ops._c10d_functional

# op -> (what it moves: "all_reduce" | "gather" | "scatter" | "send", index of its tensor(s), index of its group)
# The tensor index points at the full-size tensor: the gathered output, the scattered input.
_COLLECTIVES = {
    c10d.allreduce_.default: ("all_reduce", 0, 1),
    c10d.allreduce_coalesced_.default: ("all_reduce", 0, 1),
    funcol.all_reduce.default: ("all_reduce", 0, 2),
    funcol.all_reduce_.default: ("all_reduce", 0, 2),
    funcol.all_reduce_coalesced.default: ("all_reduce", 0, 2),
    c10d._allgather_base_.default: ("gather", 0, 2),
    c10d.allgather_into_tensor_coalesced_.default: ("gather", 0, 2),
    c10d.allgather_.default: ("gather", 0, 2),
    funcol.all_gather_into_tensor.default: ("gather", "out", 2),
    funcol.all_gather_into_tensor_coalesced.default: ("gather", "out", 2),
    c10d._reduce_scatter_base_.default: ("scatter", 1, 2),
    c10d.reduce_scatter_tensor_coalesced_.default: ("scatter", 1, 2),
    c10d.reduce_scatter_.default: ("scatter", 1, 2),
    funcol.reduce_scatter_tensor.default: ("scatter", 0, 3),
    funcol.reduce_scatter_tensor_coalesced.default: ("scatter", 0, 3),
    c10d.alltoall_base_.default: ("scatter", 1, 2),
    funcol.all_to_all_single.default: ("scatter", 0, 3),
    c10d.send.default: ("send", 0, 1),
}


_INPUT_SPLITS = {c10d.alltoall_base_.default: 4, funcol.all_to_all_single.default: 2}  # all-to-all: index of its
# input_split_sizes


class CommBytes(CommDebugMode):
    """`CommDebugMode` that also adds up the bytes this rank sends, per process group (``bytes_by_group``, keyed
    by the group's global ranks).

    Use it like its parent (``with CommBytes() as comm: ...``), then `by_axis` names the groups.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes_by_group: dict[tuple[int, ...], float] = defaultdict(float)  # by the group's global ranks
        self.bytes_by_name: dict[str, float] = defaultdict(float)  # by the process group's name
        self.ranks_by_name: dict[str, tuple[int, ...]] = {}

    def __enter__(self) -> CommBytes:
        # NOTE: CommDebugMode's per-module tracker is left out: its global module hooks lose their place when the
        # mode spans several forwards and backwards (gradient accumulation, recompute), and nothing here needs it.
        tracker = self.advanced_module_tracker
        tracker.name, tracker.module_parents_dict = "Global", {"Global": set()}
        self.comm_counts.clear()
        self.comm_module_counts = {"Global": {"forward": defaultdict(int), "backward": defaultdict(int)}}
        self.comm_module_operation_counts.clear()
        self.bytes_by_group.clear()
        self.bytes_by_name.clear()
        TorchDispatchMode.__enter__(self)
        return self

    def __exit__(self, *args: object) -> None:
        TorchDispatchMode.__exit__(self, *args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and func in _COLLECTIVES:
            kind, tensors, group = _COLLECTIVES[func]
            ranks, size, name = _group(args[group])
            payload = _nbytes(out if tensors == "out" else args[tensors])
            if func in _INPUT_SPLITS and args[_INPUT_SPLITS[func]]:  # uneven splits: what goes to the others only
                splits, me = args[_INPUT_SPLITS[func]], ranks.index(dist.get_rank())
                kind, payload = "send", payload * (sum(splits) - splits[me]) / max(1, sum(splits))
            share = {
                "all_reduce": 2 * (size - 1) / size,
                "gather": (size - 1) / size,
                "scatter": (size - 1) / size,
                "send": 1.0,
            }[kind]
            self.bytes_by_group[ranks] += share * payload
            self.bytes_by_name[name] += share * payload
            self.ranks_by_name[name] = ranks
        return out

    def by_axis(self, meshes: ParallelMeshes, outside: str = "other") -> dict[str, float]:
        """Bytes per axis of a `ParallelMeshes`; groups of no single axis (the whole world, say) go to "other".

        Groups are matched by their ranks: FSDP and DTensor may reach the same ranks through another group object.
        The replica mesh's groups (``dp_cp`` with context parallelism: the ranks that sync the weights) count as
        "dp"; with HSDP's shard groups, ZeRO's groups count as "dp_shard" and the groups' replicas as
        "dp_replicate". The ring attention's group is "cp" and the tokens' all-to-alls' is "ep", matched by name (with
        ``dp == 1`` or ``ep == dp`` their ranks are a DP group's); the expert mesh's ``edp`` groups (ranks holding
        the same experts) count as "dp".
        """
        ranks = self._ranks_by_dim(meshes.world)
        ranks[()] = outside  # groups the world does not know: torchft's between replica groups (``"replica"``)
        if meshes.replica_mesh.size() > 1:
            ranks[_ranks(meshes.replica_mesh)] = "dp"
        hybrid = meshes.layout.dp_replicate > 1
        if hybrid:  # HSDP: ZeRO's gathers and reduce-scatters in each group, the groups' all-reduce across them
            ranks[_ranks(meshes.sharding["dp_shard"])] = "dp_shard"
            ranks[_ranks(meshes.sharding["dp_replicate"])] = "dp_replicate"
        groups = (("ep", meshes.ep_group), ("cp", meshes.cp_group))
        names = {group.group_name: axis for axis, group in groups if group is not None}
        if meshes.experts is not None and meshes.experts["edp"].size() > 1:
            # (with CP its ranks may be a CP dim's: the ring goes by name); with shard groups, experts shard over all
            # the ranks that hold them, as ZeRO's shards do (by name: their ranks may be a dp_replicate group's)
            if hybrid:
                names[meshes.experts["edp"].get_group().group_name] = "dp_shard"
            else:
                ranks[_ranks(meshes.experts["edp"])] = "dp"
        return self._sum_by(ranks, names)

    def by_axis_of_mesh(self, mesh: DeviceMesh) -> dict[str, float]:
        """Bytes per dim of a device mesh (Lightning's `ModelParallelStrategy`'s)."""
        return self._sum_by(self._ranks_by_dim(mesh), {})

    @staticmethod
    def _ranks_by_dim(mesh: DeviceMesh) -> dict[tuple[int, ...], str]:
        return {_ranks(mesh[dim]): dim for dim in mesh.mesh_dim_names if mesh[dim].size() > 1}

    def _sum_by(self, ranks: dict[tuple[int, ...], str], names: dict[str, str]) -> dict[str, float]:
        axes: dict[str, float] = defaultdict(float)
        for name, sent in self.bytes_by_name.items():
            axes[names.get(name) or ranks.get(self.ranks_by_name[name], "other")] += sent
        return dict(axes)


def _group(group: Any) -> tuple[tuple[int, ...], int, str]:
    """Global ranks, size and name of a collective's group: a boxed ProcessGroup (c10d ops) or a name (functional
    ops)."""
    from torch.distributed.distributed_c10d import ProcessGroup, _resolve_process_group

    pg = _resolve_process_group(group) if isinstance(group, str) else ProcessGroup.unbox(group)
    try:
        ranks = tuple(sorted(dist.get_process_group_ranks(pg)))
    except (KeyError, RuntimeError):  # a group outside this process's world (torchft's, between replica groups): ()
        ranks = ()
    return ranks, pg.size(), pg.group_name


def _ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    return tuple(sorted(dist.get_process_group_ranks(mesh.get_group())))


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)
