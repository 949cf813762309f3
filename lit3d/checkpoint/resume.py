"""``--ckpt_path last``: the newest complete checkpoint in a run's checkpoint folders, or a fresh start.

What a requeued job needs: the same command finds where the run left off. The folders (`checkpoint_folders`) are
those of the run's `ModelCheckpoint` callbacks, and those the default one wrote into in the logger's earlier versions
of the run (``runs/tiny/version_*/checkpoints``: each run of a config without a fixed folder gets a new version).
Candidates are lit3d's checkpoint folders (and single ``.ckpt`` files) in them, newest first (by when their last file
was written); a symbolic link (Lightning's ``save_last="link"``, the ``last-preempted.ckpt`` a preempted run leaves)
counts as the checkpoint it points at. A ``.partial`` folder (a save that never finished) or an ``.old`` one (the
checkpoint a save replaced) is never a candidate; an incomplete or corrupt one is named and skipped for the one
before it. Without any candidate, training starts fresh and says so; with candidates but none complete, the command
is refused, naming them: a requeued job never silently starts over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lit3d.checkpoint.folder import PARTIAL_SUFFIX, is_sharded_checkpoint
from lit3d.checkpoint.safe_io import META_FILE, check_readable


def newest_complete_checkpoint(folders: list[Path]) -> Path | None:
    """The newest complete checkpoint among ``folders``' entries; None (said on rank 0) if there is none."""
    entries = [entry for folder in folders if folder.is_dir() for entry in folder.iterdir()]
    targets = dict.fromkeys(entry.resolve() if entry.is_symlink() else entry for entry in entries)  # once each
    candidates = [entry for entry in targets if _candidate(entry)]
    for path in sorted(candidates, key=_written, reverse=True):
        if not is_sharded_checkpoint(path):
            return path  # a single-file checkpoint (another strategy's): Lightning reads and checks it
        try:
            check_readable(path)
        except (ValueError, FileNotFoundError) as error:
            rank_zero_warn(f"--ckpt_path last: skipping {str(path)!r}: {error}; trying the one before")
            continue
        rank_zero_info(f"--ckpt_path last: resuming from {str(path)!r}")
        return path
    where = ", ".join(repr(str(folder)) for folder in folders) or "no checkpoint folder (set ModelCheckpoint's dirpath)"
    if candidates:
        names = ", ".join(repr(str(path)) for path in candidates)
        raise ValueError(
            f"--ckpt_path last: no checkpoint in {where} is complete ({names}); resume from one of them with "
            "--ckpt_path PATH, or move them away to start fresh"
        )
    rank_zero_info(f"--ckpt_path last: no checkpoint in {where}; starting fresh")
    return None


def checkpoint_folders(trainer: Any) -> list[Path]:
    """Where ``--ckpt_path last`` looks: every `ModelCheckpoint`'s ``dirpath``, and for one without a dirpath the
    folder it writes to in each of the logger's versions of the run (or the trainer's ``default_root_dir``)."""
    folders = [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
    if any(getattr(cb, "dirpath", None) is None for cb in trainer.checkpoint_callbacks):
        roots = [Path(logger.root_dir) for logger in trainer.loggers if getattr(logger, "root_dir", None)]
        folders += [version / "checkpoints" for root in roots for version in sorted(root.glob("version_*"))]
        if not trainer.loggers:
            folders.append(Path(trainer.default_root_dir) / "checkpoints")
    return list(dict.fromkeys(folders))


def _candidate(entry: Path) -> bool:
    if entry.name.endswith((PARTIAL_SUFFIX, ".old")):
        return False
    return is_sharded_checkpoint(entry) or (entry.is_file() and entry.suffix == ".ckpt")


def _written(path: Path) -> float:
    """When a checkpoint's last file was written (a folder's meta file is written last)."""
    inner = path / META_FILE if path.is_dir() else path
    return (inner if inner.exists() else path).stat().st_mtime
