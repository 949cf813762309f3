"""How `Parallel3DStrategy` saves and loads: `Checkpoints`, this rank's part of the run's checkpoints, in the format of
`lit3d.strategies.checkpoint` (a folder of shards; or, with ``save_distributed_checkpoint=False``, one file)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit3d.strategies.checkpoint import (
    PARTIAL_SUFFIX,
    check_readable,
    init_optimizer_state,
    load,
    optimizer_state_by_name,
    parameter_names,
    read_weights,
    restore_param_groups,
    save,
)
from lit3d.strategies.float8 import plain_tensors

SHARDS_SUFFIX = ".shards"  # a single-file save's shards, before rank 0 makes them one file


def remove(path: Path) -> None:
    """Delete a checkpoint folder or file (Lightning's ``save_top_k`` dropping an old one)."""
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


class Checkpoints:
    """This rank's part of the run's sharded checkpoints: every rank writes and reads its own shards, under parameter
    names, with the functions above; with ``asynchronous`` the writes go on in the background
    (`lit3d.strategies.async_checkpoint`), one in flight at most."""

    def __init__(self, asynchronous: bool = False, distributed: bool = True) -> None:
        self.asynchronous, self.distributed = asynchronous, distributed
        self._background: Any = None  # BackgroundSaves, from the first asynchronous save on

    def save(
        self, path: Path, checkpoint: dict[str, Any], islands: tuple[int, Any], is_global_zero: bool, options: Any
    ) -> None:
        """Write Lightning's ``checkpoint`` dict (its tensors as this rank's shards, the rest in `META_FILE`);
        ``islands``: this rank's DiLoCo island and the outer loop (`with_islands`)."""
        if options is not None:
            raise TypeError("Parallel3DStrategy writes sharded checkpoints itself; storage_options is not supported")
        tensors = {
            "state_dict": checkpoint.pop("state_dict"),
            "optimizer_states": checkpoint.pop("optimizer_states", []),
        }
        tensors = plain_tensors(with_islands(tensors, *islands))
        checkpoint["rng"] = _collect_rng_states()  # rank 0's; every rank was seeded alike
        if not self.distributed:  # one file of the weights: their shards written, then made whole by rank 0
            shards = path.with_name(path.name + SHARDS_SUFFIX)
            save(shards, {"state_dict": tensors["state_dict"]}, checkpoint, is_global_zero)
            failure = None
            if is_global_zero:
                try:
                    write_single_file(shards, path)
                except Exception as error:  # every rank raises, rather than wait for rank 0 in a collective
                    failure = f"{type(error).__name__}: {error}"
            _raise_on_every_rank(failure, f"writing the single-file checkpoint {str(path)!r} failed on rank 0")
            return
        if not self.asynchronous:
            save(path, tensors, checkpoint, is_global_zero)
            return
        if self._background is None:
            from lit3d.strategies.async_checkpoint import BackgroundSaves

            self._background = BackgroundSaves()
        self._background.start(path, tensors, checkpoint, is_global_zero)

    def load(
        self,
        path: Path,
        state_dict: Callable[[], dict[str, Any]],
        optimizers: list[Any],
        optimizer_state: Callable[[Any], dict[str, Any]],
        islands: tuple[int, Any],
    ) -> dict[str, Any]:
        """Fill the module's ``state_dict()`` (its shards, in place) and the ``optimizers``' states from the
        checkpoint at ``path``; return everything else it holds, with the random states restored."""
        self.wait()  # a save in flight first
        if path.is_file():
            raise ValueError(
                f"{str(path)!r} is a single-file checkpoint (save_distributed_checkpoint=False): it holds the weights "
                "only and does not resume; resume from a checkpoint folder, or start from its weights (for lit3d's "
                "GPT: `GPT(pretrained=...)`, `--model.pretrained=...`)"
            )
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


def write_single_file(folder: Path, path: Path) -> None:
    """``path``: the checkpoint ``folder`` as one file, as Lightning's ``ModelParallelStrategy`` writes it with
    ``save_distributed_checkpoint=False``: the whole weights and what Lightning saved (`read_weights`), which a plain
    ``LightningModule`` loads on one device. Like Lightning's ``save_weights_only``, it holds no optimizer state;
    the folder is removed once the file is in place."""
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    torch.save(read_weights(folder), partial)
    if path.is_dir():
        shutil.rmtree(path)
    partial.replace(path)
    shutil.rmtree(folder)


def _raise_on_every_rank(failure: str | None, what: str) -> None:
    """Rank 0's ``failure`` (or None), raised on every rank alike."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        shared = [failure]
        dist.broadcast_object_list(shared, src=0)
        failure = shared[0]
    if failure is not None:
        raise RuntimeError(f"{what}: {failure}")
