"""Lightning's single-file checkpoint for `Parallel3DStrategy` (``save_distributed_checkpoint=False``): the whole state
on rank 0, as one process holds it, and such a file loaded into any layout.

A single file is what ``ddp``, ``auto`` and ``ModelParallelStrategy(save_distributed_checkpoint=False)`` write and
read: the weights whole, by name (the module's ``state_dict`` order), and each optimizer's ``state_dict()`` in
PyTorch's own format, its parameters numbered across its groups in the order the one-process optimizer holds them. So
a run moves between those strategies and lit3d in either direction, optimizer states included.

The numbering is the one thing a split run does not know by itself: a pipeline rank holds some of the parameters
only. The strategy records the network's parameter order before it splits it (`WholeOrder`); each group's numbers are
its parameters in that order, the names gathered from every rank.

NOTE: torch's ``get_model_state_dict(full_state_dict=True)`` gathers a module's DTensors, but neither across pipeline
stages nor for ZeRO-1's local shards (plain tensors the optimizer steps), and FSDP's ``rekey_optim_state_dict``
numbers by ``module.parameters()`` order, which is not the optimizer's once it has two groups (AdamW's decay and
no-decay): so the gathering and the numbering are written here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lit3d.parallel.layout import Layout


@dataclass(frozen=True)
class WholeOrder:
    """The whole module's names, in its order, as one process holds it: ``keys`` of its ``state_dict``,
    ``parameters`` as ``named_parameters`` gives them (a tied weight once)."""

    keys: tuple[str, ...]
    parameters: tuple[str, ...]

    @classmethod
    def of(cls, module: torch.nn.Module) -> WholeOrder:
        return cls(tuple(module.state_dict()), tuple(name for name, _ in module.named_parameters()))


def whole_on_rank_zero(tensors: dict[str, Any], layout: Layout, rank: int, order: tuple[str, ...]) -> dict[str, Any]:
    """Collective: ``tensors`` (this rank's, by name: DTensor shards, ZeRO-1's global views, plain tensors, other
    values) whole and on the CPU, every pipeline stage's, in ``order``, on rank 0; an empty dict on every other rank.

    Every rank gathers its DTensors over their own meshes (the ranks of a stage hold the same names, in the same
    order); then one rank of each later stage sends its stage's to rank 0."""
    coordinate = layout.coordinate(rank)
    sends = layout.pp > 1 and rank != 0 and coordinate.d == coordinate.c == coordinate.t == 0
    sends = sends and layout.island(rank) == 0
    whole = {}
    for name, value in tensors.items():
        value = _whole(value)  # (a collective for a DTensor: every rank of its mesh)
        if rank == 0 or sends:  # NOTE: the others drop each tensor at once: no rank but these holds the whole
            whole[name] = value
    if layout.pp > 1:
        parts = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(whole if sends else None, parts, dst=0)
        if rank == 0:
            for part in parts:
                whole.update(part or {})
    if rank != 0:
        return {}
    position = {name: i for i, name in enumerate(order)}
    return dict(sorted(whole.items(), key=lambda item: position.get(item[0], len(position))))


def numbering(groups: list[list[str]], layout: Layout, order: tuple[str, ...]) -> list[list[str]]:
    """Collective under a pipeline: each optimizer group's parameter names in the whole run, in ``order`` (a group
    lists a name's position in the one-process optimizer: its number is its place here, counted across groups)."""
    if layout.pp > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, groups)
        groups = [sorted({name for rank_groups in every for name in rank_groups[g]}) for g in range(len(groups))]
    position = {name: i for i, name in enumerate(order)}
    return [sorted(names, key=lambda name: position.get(name, len(position))) for names in groups]


def positional(by_name: dict[str, Any], layout: Layout, rank: int, order: tuple[str, ...]) -> dict[str, Any]:
    """Collective: an optimizer's state by parameter name (`lit3d.checkpoint.folder.optimizer_state_by_name`,
    shards placed globally) as one process's ``optimizer.state_dict()``, on rank 0; an empty dict elsewhere."""
    names = numbering([group["params"] for group in by_name["param_groups"]], layout, order)
    numbers = {name: i for i, name in enumerate(name for group in names for name in group)}
    flat = {f"{name}\0{key}": value for name, state in by_name["state"].items() for key, value in state.items()}
    whole = whole_on_rank_zero(flat, layout, rank, ())
    if rank != 0:
        return {}
    state: dict[int, dict[str, Any]] = {}
    for flat_key, value in whole.items():
        name, key = flat_key.split("\0")
        state.setdefault(numbers[name], {})[key] = value
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [numbers[name] for name in group_names]}
        for group, group_names in zip(by_name["param_groups"], names)
    ]
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def load_positional(saved: dict[str, Any], by_name: dict[str, Any], layout: Layout, order: tuple[str, ...]) -> None:
    """Collective under a pipeline: fill ``by_name`` (this rank's optimizer state by name, in place: shards and
    ZeRO-1's views) from one process's ``optimizer.state_dict()`` ``saved``; set its groups' hyper-parameters.
    Raises, naming the counts, when the saved optimizer's groups do not hold this run's parameters."""
    names = numbering([group["params"] for group in by_name["param_groups"]], layout, order)
    saved_groups = saved.get("param_groups", [])
    counts, expected = [len(group["params"]) for group in saved_groups], [len(group) for group in names]
    if counts != expected:
        raise ValueError(
            f"the checkpoint's optimizer has {len(counts)} parameter group(s) of {counts} parameters, this run's "
            f"{len(expected)} of {expected}: it was configured differently (`configure_optimizers`)"
        )
    for group, saved_group, group_names in zip(by_name["param_groups"], saved_groups, names):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
        numbers = dict(zip(group_names, saved_group["params"]))
        for name in group["params"]:
            source = saved["state"].get(numbers[name], {})
            for key, target in by_name["state"].get(name, {}).items():
                if key not in source:
                    raise ValueError(f"the checkpoint's optimizer holds no {key!r} for {name!r}")
                copy_whole(target, source[key])


@torch.no_grad()
def copy_whole(target: Any, source: Any) -> None:
    """Copy a whole tensor into ``target`` (this rank's shard of a DTensor, or a plain tensor), no communication."""
    from torch.distributed.tensor import distribute_tensor

    if not isinstance(target, torch.Tensor):
        return
    if tuple(source.shape) != tuple(target.shape):
        raise ValueError(f"a tensor of shape {tuple(source.shape)} does not fit {tuple(target.shape)}")
    if isinstance(target, DTensor):  # src_data_rank=None: each rank cuts its own shard from its own copy
        source = distribute_tensor(source.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(source.to_local())
        return
    target.copy_(source)


def _whole(value: Any) -> Any:
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value
