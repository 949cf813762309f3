"""How `Parallel3DStrategy` saves and loads: `Checkpoints`, this rank's part of the run's checkpoints, in the format of
`lit3d.checkpoint.folder` (a folder of shards), or with ``save_distributed_checkpoint=False`` Lightning's one
file (`lit3d.checkpoint.whole_file`); single files of other strategies load too."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit3d.checkpoint.folder import (
    PARTIAL_SUFFIX,
    as_plain_data,
    check_same_optimizer,
    init_optimizer_state,
    is_own_folder,
    load,
    optimizer_state_by_name,
    parameter_names,
    replace_refusal,
    restore_param_groups,
    save,
)
from lit3d.checkpoint.plain import plain_tensors
from lit3d.checkpoint.safe_io import META_FILE, check_readable, load_meta
from lit3d.checkpoint.whole_file import WholeOrder, copy_whole, load_positional, positional, whole_on_rank_zero


def remove(path: Path) -> None:
    """Delete a checkpoint folder or file (Lightning's ``save_top_k`` dropping an old one); a folder lit3d did not
    write is kept, with a warning."""
    if path.is_dir() and not is_own_folder(path):
        rank_zero_warn(f"not removing {str(path)!r}: a folder lit3d did not write")
        return
    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def optimizer_state(optimizer: Any, module: nn.Module, local: Any = None) -> dict[str, Any]:
    """The optimizer's state by parameter name; ``local``: its `LocalShardOptimizer`, if it steps on local shards."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
    names = parameter_names(module)
    if local is None:
        return optimizer_state_by_name(optimizer, names)
    # Name each view after its parameter, and give its states their place in the global tensor.
    names.update({id(e.view): names[id(e.param)] for e in local.entries})
    return optimizer_state_by_name(optimizer, names, local.as_global)


def with_islands(tensors: dict[str, Any], island: int, outer_loop: Any) -> dict[str, Any]:
    """Under DiLoCo (an ``outer_loop``): each island's own weights and inner optimizer states (they differ between
    outer steps), island ``i > 0``'s under ``island<i>.`` (island 0's keep the plain names, which every other reader
    takes), and the outer loop's anchor, momentum and step count under ``outer.`` (the same in every island)."""
    if outer_loop is None:
        return tensors
    return {**(tensors if island == 0 else {f"island{island}": tensors}), "outer": outer_loop.state_by_name()}


@dataclass(frozen=True)
class RankState:
    """What this rank's checkpoints read and fill: the module, its optimizers' steps (`OptimizerSteps`: ZeRO-1's local
    shards and master weights, DiLoCo's outer loop; None before setup), and, once set up, the layout and this rank in
    it; ``order``: the whole module's names before a split (`WholeOrder`), else the module's own."""

    module: nn.Module
    optimizer_steps: Any
    layout: Any
    rank: int
    order: WholeOrder | None = None

    def sharded(self) -> dict[str, Any]:
        """The module's state dict: DTensor shards under layout-free names, the fp32 master weights where kept."""
        state = self.module.state_dict()
        return state if self.optimizer_steps is None else self.optimizer_steps.with_master_weights(self.module, state)

    def optimizer_by_name(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
        local = self.optimizer_steps.local.get(id(optimizer)) if self.optimizer_steps is not None else None
        return optimizer_state(optimizer, self.module, local)

    def islands(self) -> tuple[int, Any]:
        """This rank's DiLoCo island and the outer loop (`with_islands`); one island before setup."""
        if self.layout is None:
            return 0, None
        outer_loop = self.optimizer_steps.outer_loop if self.optimizer_steps is not None else None
        return self.layout.island(self.rank), outer_loop

    def whole_order(self) -> WholeOrder:
        return self.order or WholeOrder.of(self.module)


class Checkpoints:
    """This rank's part of the run's checkpoints: every rank writes and reads its own shards, under parameter names,
    with the functions above; with ``asynchronous`` the writes go on in the background
    (`lit3d.checkpoint.background`), one in flight at most. With ``distributed=False``, one file of the whole
    state, Lightning's format (`lit3d.checkpoint.whole_file`), written by rank 0."""

    def __init__(self, asynchronous: bool = False, distributed: bool = True) -> None:
        self.asynchronous, self.distributed = asynchronous, distributed
        self._background: Any = None  # BackgroundSaves, from the first asynchronous save on

    def module_state(self, rank: RankState) -> dict[str, Any]:
        """Shards by name; with ``distributed=False`` the whole state on rank 0, {} elsewhere (a collective)."""
        if self.distributed:
            return rank.sharded()
        whole = whole_on_rank_zero(plain_tensors(rank.sharded()), rank.layout, rank.rank, rank.whole_order().keys)
        return whole

    def optimizer_state(self, rank: RankState, optimizer: Any) -> dict[str, Any]:
        """By parameter name; with ``distributed=False`` one process's ``state_dict()`` on rank 0 (a collective)."""
        if self.distributed:
            return rank.optimizer_by_name(optimizer)
        by_name = plain_tensors(rank.optimizer_by_name(optimizer))
        return positional(by_name, rank.layout, rank.rank, rank.whole_order().parameters)

    def save(
        self, path: Path, checkpoint: dict[str, Any], islands: tuple[int, Any], is_global_zero: bool, options: Any
    ) -> None:
        """Write Lightning's ``checkpoint`` dict: its tensors as this rank's shards and the rest in `META_FILE`
        (``islands``: this rank's DiLoCo island and the outer loop, `with_islands`); or, with ``distributed=False``,
        the whole of it (rank 0's holds the whole state) as one file. A folder at ``path`` that lit3d did not write
        is refused on every rank before any writes (`replace_refusal`)."""
        if options is not None:
            raise TypeError("Parallel3DStrategy writes sharded checkpoints itself; storage_options is not supported")
        _raise_on_every_rank(replace_refusal(path, single_file=not self.distributed) if is_global_zero else None)
        checkpoint["rng"] = plain_rng(_collect_rng_states())  # rank 0's; every rank was seeded alike
        if not self.distributed:
            failure = None
            if is_global_zero:
                try:
                    write_file(as_plain_data(checkpoint), path)
                except Exception as error:  # every rank raises, rather than wait for rank 0 in a collective
                    failure = RuntimeError(f"writing the checkpoint file {str(path)!r} failed on rank 0: {error}")
            _raise_on_every_rank(failure)
            return
        tensors = {
            "state_dict": checkpoint.pop("state_dict"),
            "optimizer_states": checkpoint.pop("optimizer_states", []),
        }
        tensors = plain_tensors(with_islands(tensors, *islands))
        if not self.asynchronous:
            save(path, tensors, as_plain_data(checkpoint), is_global_zero)
            return
        if self._background is None:
            from lit3d.checkpoint.background import BackgroundSaves

            self._background = BackgroundSaves()
        self._background.start(path, tensors, as_plain_data(checkpoint), is_global_zero)

    def load(self, path: Path, rank: RankState, optimizers: list[Any]) -> dict[str, Any]:
        """Fill this rank's shards of the module and the ``optimizers``' states from the checkpoint at ``path`` (a
        folder, or a single file: Lightning's, of any strategy); return everything else it holds."""
        check_loadable(path)  # a missing, empty or broken folder is named before anything else
        if rank.layout is None or rank.module is None:
            raise RuntimeError(
                f"loading {str(path)!r} needs a module that a Trainer has set up: `trainer.fit(..., ckpt_path=...)`"
            )
        if path.is_file():
            if rank.islands()[1] is not None:
                raise ValueError(
                    f"{str(path)!r} is a single-file checkpoint: a DiLoCo run resumes from its own checkpoint folder "
                    "(its islands and outer loop); start from the file's weights instead (`--model.pretrained=...`)"
                )
            by_name, order = rank.optimizer_by_name, rank.whole_order()
            trained = getattr(rank.module, "optimizer_name", None) if optimizers else None
            meta = self.load_file(path, rank.sharded(), optimizers, by_name, rank.layout, order, trained)
        else:
            if optimizers and (path / META_FILE).is_file():
                check_same_optimizer(path, load_meta(path / META_FILE), rank.module)
            meta = self.load_folder(path, rank.sharded, optimizers, rank.optimizer_by_name, rank.islands())
        if rank.optimizer_steps is not None:
            rank.optimizer_steps.master_weights_loaded()
        return meta

    def load_folder(
        self,
        path: Path,
        state_dict: Callable[[], dict[str, Any]],
        optimizers: list[Any],
        optimizer_state: Callable[[Any], dict[str, Any]],
        islands: tuple[int, Any],
    ) -> dict[str, Any]:
        """Fill the module's ``state_dict()`` (its shards, in place) and the ``optimizers``' states from the
        checkpoint folder at ``path``; return everything else it holds, with the random states restored."""
        self.wait()  # a save in flight first
        check_readable(path)
        tensors: dict[str, Any] = {"state_dict": state_dict()}
        if optimizers:
            for optimizer in optimizers:
                init_optimizer_state(optimizer)
            tensors["optimizer_states"] = [optimizer_state(opt) for opt in optimizers]
        meta = load(path, plain_tensors(with_islands(tensors, *islands)))  # in place; hyper-parameters as values
        for optimizer, loaded in zip(optimizers, tensors.get("optimizer_states", [])):
            restore_param_groups(optimizer, loaded)
        if "rng" in meta:
            _set_rng_states(meta.pop("rng"))
        return meta

    def load_file(
        self,
        path: Path,
        state_dict: dict[str, Any],
        optimizers: list[Any],
        optimizer_state: Callable[[Any], dict[str, Any]],
        layout: Any,
        order: WholeOrder,
        optimizer_name: str | None = None,
    ) -> dict[str, Any]:
        """Fill the module's shards and the ``optimizers``' states from a single-file checkpoint (lit3d's, or one
        ``ddp``, ``auto`` or ``ModelParallelStrategy`` wrote), whole on every rank; return everything else it holds.
        Collective under a pipeline (the optimizers' numbering, `lit3d.checkpoint.whole_file`). ``optimizer_name``:
        lit3d's GPT's, which the checkpoint must have trained with (`check_same_optimizer`)."""
        self.wait()
        checkpoint = load_meta(path)
        if optimizer_name is not None:
            check_same_optimizer(path, checkpoint, optimizer_name)
        saved = checkpoint.pop("state_dict", None)
        if not isinstance(saved, dict):
            raise ValueError(f"{str(path)!r} holds no `state_dict`: it is not a Lightning checkpoint")
        state_dict = plain_tensors(state_dict)
        missing = [name for name in state_dict if name not in saved]
        if missing:
            raise ValueError(
                f"checkpoint {str(path)!r} does not fit this model: {len(missing)} missing keys, e.g. {missing[:5]}"
            )
        for name, target in state_dict.items():
            try:
                copy_whole(target, saved[name])
            except ValueError as error:
                raise ValueError(f"checkpoint {str(path)!r} does not fit this model: {name!r}: {error}") from None
        saved_optimizers = checkpoint.pop("optimizer_states", None)
        if optimizers and len(saved_optimizers or []) != len(optimizers):
            raise ValueError(
                f"{str(path)!r} holds {len(saved_optimizers or [])} optimizer state(s), this run has "
                f"{len(optimizers)}: a weights-only checkpoint does not resume training; start from its weights "
                "instead (for lit3d's GPT: `GPT(pretrained=...)`, `--model.pretrained=...`)"
            )
        for optimizer, saved_optimizer in zip(optimizers, saved_optimizers or []):
            init_optimizer_state(optimizer)
            by_name = plain_tensors(optimizer_state(optimizer))
            try:
                load_positional(saved_optimizer, by_name, layout, order.parameters)
            except ValueError as error:
                raise ValueError(f"checkpoint {str(path)!r}: {error}") from None
            restore_param_groups(optimizer, by_name)
        if "rng" in checkpoint:
            _set_rng_states(checkpoint.pop("rng"))
        return checkpoint

    def wait(self, agree: bool = True) -> None:
        """Block until a save in flight is complete; raise if it failed (naming the folder)."""
        if self._background is not None:
            self._background.wait(agree)

    def abandon(self) -> None:
        """The fit ended by an error: wait for a save in flight without agreeing with the other ranks, and warn if it
        failed."""
        if self._background is not None and self._background.pending is not None:
            try:
                self._background.wait(agree=False)
            except RuntimeError as error:
                rank_zero_warn(str(error))


def check_loadable(path: Path) -> None:
    """A clear error for a missing file or a missing, empty, incomplete or broken folder (before any collective)."""
    if not path.is_file():
        check_readable(path)


def write_file(checkpoint: dict[str, Any], path: Path) -> None:
    """``checkpoint`` as one file at ``path``: written beside it first, then moved into place (an own checkpoint
    folder there is replaced), so a crash during the write leaves what was there."""
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, partial)
    if path.is_dir():
        shutil.rmtree(path)
    partial.replace(path)


def plain_rng(states: dict[str, Any]) -> dict[str, Any]:
    """Lightning's random states with numpy's key as a list, so that ``torch.load``'s default reads it."""
    if "numpy" in states:
        kind, key, *rest = states["numpy"]
        states["numpy"] = (kind, [int(k) for k in key], *rest)
    return states


def _raise_on_every_rank(failure: BaseException | None) -> None:
    """Rank 0's ``failure`` (an exception, or None) raised on every rank alike."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        shared = [failure]
        dist.broadcast_object_list(shared, src=0)
        failure = shared[0]
    if failure is not None:
        raise failure
