"""``--ckpt_path last``: the newest complete checkpoint in a run's checkpoint folders, or a fresh start.

What a requeued job needs: the same command finds where the run left off. Candidates are lit3d's checkpoint
folders (and single ``.ckpt`` files) in the folders of the run's `ModelCheckpoint` callbacks, newest first (by
when their last file was written); a symbolic link (Lightning's ``save_last="link"``, the ``last-preempted.ckpt``
a preempted run leaves) counts as the checkpoint it points at. A ``.partial`` folder (a save that never finished)
or an ``.old`` one (the checkpoint a save replaced) is never a candidate; an incomplete or corrupt one is refused
with a message naming it, and the one before it is tried. With none left, training starts fresh and says so.
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lit3d.strategies.checkpoint import META_FILE, PARTIAL_SUFFIX, check_readable, is_sharded_checkpoint


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
    rank_zero_info(f"--ckpt_path last: no complete checkpoint in {where}; starting fresh")
    return None


def _candidate(entry: Path) -> bool:
    if entry.name.endswith((PARTIAL_SUFFIX, ".old")):
        return False
    return is_sharded_checkpoint(entry) or (entry.is_file() and entry.suffix == ".ckpt")


def _written(path: Path) -> float:
    """When a checkpoint's last file was written (a folder's meta file is written last)."""
    inner = path / META_FILE if path.is_dir() else path
    return (inner if inner.exists() else path).stat().st_mtime
