"""Sharded, layout-free checkpoints with `torch.distributed.checkpoint` (DCP).

A checkpoint is a folder::

    step=100.ckpt/
        .metadata, __*.distcp   model and optimizer tensors; every rank writes its own shards
        meta.pt                 everything else Lightning saves (loops, schedulers, callbacks, data position)

Tensors are keyed by parameter name (``model.blocks.3.attn.q_proj.weight``, and
``optimizer.0.state.<name>.exp_avg``), and DCP records each shard's place in the global tensor, so any layout
(DP, TP, PP sizes, ZeRO stage) can read what any other layout wrote.

A save goes to ``<folder>.partial`` and is renamed into place only once every rank has finished, so a crash
or kill during a save leaves the previous checkpoint untouched.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch.distributed.checkpoint.api import CheckpointException  # NOTE: a BaseException, not an Exception
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lit3d.checkpoint.safe_io import (
    META_FILE,
    SafeEmptyLoadPlanner,
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    check_readable,
    load_meta,
)
from lit3d.outputs import is_checkpoint_file, refusal

PARTIAL_SUFFIX = ".partial"


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    as_global: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name instead of position.

    ``names`` maps id(optimizer tensor) to its parameter's name; ``as_global(tensor, state)`` may re-express a
    state tensor in global coordinates (a DTensor sharing its storage). Loading into the returned dict in place
    loads the optimizer.
    """
    as_global = as_global or (lambda tensor, state: state)
    state, groups = {}, []
    for group in optimizer.param_groups:
        keys = [names[id(p)] for p in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": keys})
        for key, param in zip(keys, group["params"]):
            if param in optimizer.state:
                state[key] = {
                    k: as_global(param, v) if isinstance(v, torch.Tensor) else v
                    for k, v in optimizer.state[param].items()
                }
    return {"state": state, "param_groups": groups}


def restore_param_groups(optimizer: torch.optim.Optimizer, loaded: dict[str, Any]) -> None:
    """After an in-place load of `optimizer_state_by_name`'s dict: the hyper-parameters (lr, betas, ...)."""
    for group, saved in zip(optimizer.param_groups, loaded["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's (lazy) state with a zero-learning-rate step on zero gradients, so a checkpoint
    can be loaded into it in place. The parameters do not change."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for p in params:
        p.grad = None


def save(path: Path, tensors: dict[str, Any], meta: dict[str, Any], is_global_zero: bool) -> None:
    """Collective: every rank writes its shards of ``tensors``; rank 0 writes ``meta`` and publishes the folder."""
    partial = prepare_partial(path, is_global_zero)
    dcp.save(tensors, checkpoint_id=str(partial))
    if is_global_zero:
        torch.save(meta, partial / META_FILE)
    _barrier()
    if is_global_zero:
        publish(path, partial)
    _barrier()


def prepare_partial(path: Path, is_global_zero: bool) -> Path:
    """Collective: the ``.partial`` folder a save of ``path`` writes into, emptied of an interrupted save's files."""
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    if is_global_zero and partial.exists():
        shutil.rmtree(partial)
    _barrier()
    return partial


def publish(path: Path, partial: Path) -> None:
    """Move a complete ``partial`` folder into place at ``path`` (rank 0), replacing what was there."""
    previous = path.with_name(path.name + ".old")
    if path.exists():
        if previous.is_dir() and is_own_folder(previous):  # an interrupted publish's: ``path`` is newer
            shutil.rmtree(previous)
        path.rename(previous)
    partial.rename(path)
    if previous.exists():
        shutil.rmtree(previous) if previous.is_dir() else previous.unlink()


def is_own_folder(path: Path) -> bool:
    """Whether lit3d may replace or delete the folder ``path``: it holds only what a sharded checkpoint holds (DCP's
    ``.metadata`` and ``*.distcp`` shards, `META_FILE`: lit3d's, or Lightning's ``ModelParallelStrategy``'s), or
    nothing."""
    own = lambda entry: entry.is_file() and (entry.name in (".metadata", META_FILE) or entry.suffix == ".distcp")
    return all(own(entry) for entry in path.iterdir())


def replace_refusal(path: Path, single_file: bool) -> OSError | None:
    """Why a save to ``path`` must not start, or None: lit3d's one rule (`lit3d.outputs.refusal`) for a checkpoint
    file or folder there, and for a folder at its ``.partial`` name (where a save writes first). Replaced: an own
    checkpoint folder (`is_own_folder`) or checkpoint file (`is_checkpoint_file`), and an interrupted save's
    ``.partial`` file; refused: anything else (a folder for a single file with `IsADirectoryError`, as Lightning's)."""
    writes = None if single_file else ("*",)  # a folder is replaced whole
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    return refusal(path, "checkpoint", is_own_checkpoint, writes, flag=None) or refusal(
        partial, "checkpoint", lambda found: found.is_file() or is_own_folder(found), ("*",), flag=None
    )


def is_own_checkpoint(path: Path) -> bool:
    """Whether a save may replace ``path``: a checkpoint folder or file lit3d (or Lightning) wrote."""
    return is_own_folder(path) if path.is_dir() else is_checkpoint_file(path)


def as_plain_data(tree: Any) -> Any:
    """``tree`` with Lightning's dict subclasses (``AttributeDict``: hyper-parameters) as plain dicts, so that
    ``torch.load``'s default (``weights_only=True``) reads the file."""
    if isinstance(tree, dict):
        return {key: as_plain_data(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple) and type(tree) in (list, tuple):
        return type(tree)(as_plain_data(value) for value in tree)
    return tree


def check_ckpt_path(ckpt_path: Any, resuming: Any = None) -> None:
    """A ``ckpt_path`` given to ``fit``/``validate``/...: Lightning's names (``last``, ``best``, ...) pass, a lit3d
    folder must be complete, anything else must be an existing file. Raises before any rank starts. ``resuming``: the
    module a fit resumes, whose optimizer a folder's must be (`check_same_optimizer`)."""
    if (
        ckpt_path is None
        or str(ckpt_path) in ("last", "best", "hpc", "registry")
        or str(ckpt_path).startswith("registry:")
    ):
        return
    if Path(ckpt_path).is_dir():
        # NOTE: `check_readable`, then meta.pt: a broken one is refused before any rank starts
        meta = load_meta(ckpt_path)
        if resuming is not None:
            check_same_optimizer(Path(ckpt_path), meta, resuming)
    elif not Path(ckpt_path).is_file():
        raise FileNotFoundError(f"ckpt_path={str(ckpt_path)!r} does not exist")


def check_same_optimizer(path: Path, checkpoint: dict[str, Any], trained: Any) -> None:
    """Refuse by name to resume with another optimizer than the one ``checkpoint`` (at ``path``; its hyper-parameters,
    lit3d's GPT's ``optimizer``) trained with: its states are the other optimizer's. ``trained``: this run's module,
    or its optimizer's name; nothing to check for a module that does not name one."""
    ours = trained if isinstance(trained, str) or trained is None else getattr(trained, "optimizer_name", None)
    hyper = checkpoint.get("hyper_parameters") or {}
    if ours is None or ("optimizer" not in hyper and ours == "adamw"):
        return
    theirs = hyper.get("optimizer", "adamw")  # (lit3d 0.4's GPT: AdamW only)
    if theirs != ours:
        raise ValueError(
            f"checkpoint {str(path)!r} was trained with optimizer={theirs!r}, this run with {ours!r}: its optimizer "
            f"states are {theirs}'s; resume with --model.optimizer={theirs}, or start {ours} afresh from its weights "
            f"(--model.pretrained={path})"
        )


def check_shapes(path: Path, template: dict[str, Any]) -> None:
    """Compare the tensors a checkpoint holds with the ones this run expects; name every mismatch."""
    stored = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    expected = _flatten(template)
    model_first = lambda key: (not key.startswith("state_dict."), key)
    missing = sorted((k for k in expected if k not in stored), key=model_first)
    wrong = [
        f"{k}: checkpoint {tuple(stored[k].size)} vs model {tuple(v.shape)}"
        for k, v in sorted(expected.items(), key=lambda item: model_first(item[0]))
        if k in stored
        and isinstance(v, torch.Tensor)
        and hasattr(stored[k], "size")
        and tuple(stored[k].size) != tuple(v.shape)
    ]
    if missing or wrong:
        lines = [f"checkpoint {str(path)!r} does not fit this model:"]
        if missing:
            lines.append(f"  {len(missing)} missing keys, e.g. {missing[:5]}")
        if wrong:
            lines.append(f"  {len(wrong)} shape mismatches, e.g. {wrong[:5]}")
        raise ValueError("\n".join(lines))


def load(path: Path, tensors: dict[str, Any]) -> dict[str, Any]:
    """Collective: fill ``tensors`` in place from the checkpoint (any layout); return the saved meta dict."""
    check_shapes(path, tensors)
    try:
        dcp.load(tensors, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
        return load_meta(path / META_FILE)
    except UnsafeCheckpointError:
        raise
    except (Exception, CheckpointException) as error:  # DCP raises on every rank when any rank fails to read
        raise RuntimeError(
            f"reading checkpoint {str(path)!r} failed (a truncated or corrupted file?): {error}"
        ) from error


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a lit3d checkpoint folder (complete or not), rather than a single file."""
    return Path(path).is_dir() and ((Path(path) / META_FILE).exists() or (Path(path) / ".metadata").exists())


def read_weights(path: str | Path) -> dict[str, Any]:
    """A lit3d checkpoint folder of any layout as a one-process Lightning checkpoint: what Lightning saved (loops,
    hyper-parameters, callbacks, data position) and the whole weights as plain tensors under ``state_dict``.

    The optimizer states stay in the folder: they resume only under `Parallel3DStrategy` (in any layout). No
    process group is needed; DCP reassembles every tensor from the shards' recorded offsets.
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    check_readable(path)
    state: dict[str, Any] = {}
    # NOTE: DCP's public load needs a template of every tensor; this planner builds it from the checkpoint's own
    # metadata (the way `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` reads a checkpoint).
    planner = SafeEmptyLoadPlanner(keys={"state_dict"})
    _load_state_dict(state, storage_reader=SafeFileSystemReader(str(path)), planner=planner, no_dist=True)
    meta = load_meta(path / META_FILE)
    meta.pop("rng", None)  # rank 0's random states: for an exact resume in the folder's own strategy only
    return {**meta, "state_dict": state["state_dict"]}


class ShardedCheckpointReader(TorchCheckpointIO):
    """Lightning's checkpoint IO that also reads lit3d's sharded folders, for any other strategy (``auto``, ``ddp``):
    a folder's weights load whole on every process (see `read_weights`). Files and folders are read as data only
    (`lit3d.checkpoint.safe_io`). The CLI adds it; in Python pass ``Trainer(plugins=[ShardedCheckpointReader()])``."""

    @override
    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        return FolderWeights(read_weights(path), path) if is_sharded_checkpoint(path) else load_meta(path)


class FolderWeights(dict):
    """`read_weights` of a lit3d folder, as another strategy gets it: asked for its optimizer states (Lightning asks
    before it resumes a fit), it says where they are and how to go on (`resume_refusal`) rather than Lightning's
    "checkpoint contains only the model ... save_weights_only"."""

    def __init__(self, checkpoint: dict[str, Any], path: Any) -> None:
        super().__init__(checkpoint)
        self.path = path

    def __contains__(self, key: object) -> bool:
        if key == "optimizer_states":
            raise ValueError(resume_refusal(self.path))
        return super().__contains__(key)


def resume_refusal(path: Any, strategy: str = "another strategy") -> str:
    """Why a fit under ``strategy`` cannot resume the lit3d checkpoint folder ``path``, and what can."""
    return (
        f"{str(path)!r} is a lit3d checkpoint folder: its optimizer states resume only under Parallel3DStrategy "
        f"(--trainer.strategy=3d, in any layout). Under {strategy}, start from its weights with a new optimizer "
        f"(--model.pretrained={path}, or one file: lit3d convert --ckpt_path {path} --output FILE); a run saved with "
        "--trainer.strategy.save_distributed_checkpoint=false writes one file that every strategy resumes"
    )


def parameter_names(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(tree, list):
        return _flatten({str(i): v for i, v in enumerate(tree)}, prefix)
    return {prefix: tree} if isinstance(tree, (torch.Tensor, DTensor)) else {}


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
