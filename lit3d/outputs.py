"""What lit3d may write over: one rule for every command that writes (fit's checkpoints, ``lit3d export``, ``convert``,
``prepare``, ``calibrate``, ``plan --html``), and how lit3d knows a file of its own.

The rule (`refusal`): writing never destroys a file lit3d did not write. A writer names what it writes: one file, or a
folder and the names it puts there (glob patterns; ``("*",)`` for a folder replaced whole). Nothing there, or an output
of the same kind that lit3d wrote (the writer's ``is_own``), is replaced; a user's files beside those names are kept;
anything else is refused before any work, naming the files, unless the user says ``overwrite``. A folder is never
replaced by a file, ``overwrite`` or not.

Outputs lit3d knows as its own: a checkpoint file is a ``torch.save`` zip whose pickle holds a ``state_dict`` key
(Lightning's and ``lit3d convert``'s: `is_checkpoint_file`); an exported folder's safetensors carry `MARK` in their
metadata (`is_export_folder`: HuggingFace's loaders ignore it); a checkpoint folder, a profile and a planner page are
recognised beside their writers. ``lit3d prepare`` replaces no folder unasked, its own neither (tokenizing can take
hours).

NOTE: a module of its own, on the standard library only: ``lit3d calibrate`` and ``lit3d plan`` ask it before torch
loads, and the strategies and `lit3d.hf` below the CLI import it too. `lit3d.errors` holds error classes, not rules.
"""

from __future__ import annotations

import json
import pickletools
import shutil
import zipfile
from collections.abc import Callable
from fnmatch import fnmatchcase
from pathlib import Path

OVERWRITE = "--overwrite"
MARK = {"written_by": "lit3d"}  # in the metadata of the safetensors files lit3d exports


def refusal(
    path: str | Path,
    what: str,
    is_own: Callable[[Path], bool],
    writes: tuple[str, ...] | None = None,
    overwrite: bool = False,
    flag: str | None = OVERWRITE,
) -> OSError | None:
    """Why writing the ``what`` at ``path`` must not start, or None: ``writes`` None for one file, else the names (glob
    patterns) it puts in the folder ``path``. ``flag``: how the user says ``overwrite`` (None: they cannot)."""
    path = Path(path)
    if not path.exists() or is_own(path):
        return None
    if path.is_dir() and writes is None:
        return IsADirectoryError(
            f"{str(path)!r} exists and is a directory lit3d did not write as a {what} (it holds "
            f"{_few(sorted(entry.name for entry in path.iterdir()))}): give another path, or move that folder away"
        )
    if overwrite:
        return None
    if path.is_dir():
        lost = _replaced(path, writes)
        if not lost:
            return None  # only files beside what it writes
        return FileExistsError(
            f"{str(path)!r} exists and is not empty: it holds {_few(lost)}, which the {what} would replace; "
            f"{_remedy(flag, len(lost))}"
        )
    return FileExistsError(f"{str(path)!r} exists and is not a {what} lit3d wrote; {_remedy(flag, 1)}")


def check_output(
    path: str | Path,
    what: str,
    is_own: Callable[[Path], bool],
    writes: tuple[str, ...] | None = None,
    overwrite: bool = False,
) -> Path:
    """Raise `refusal`'s error, if any; else ``path``."""
    error = refusal(path, what, is_own, writes, overwrite)
    if error is not None:
        raise error
    return Path(path)


def make_folder(
    path: str | Path, what: str, is_own: Callable[[Path], bool], writes: tuple[str, ...], overwrite: bool = False
) -> Path:
    """`check_output` for a folder, then the folder made, with what the new output replaces removed (a file at
    ``path``, and the entries ``writes`` names): nothing of an earlier output stays, and what `written` lists
    afterwards is what was written."""
    path = check_output(path, what, is_own, writes, overwrite)
    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    for name in _replaced(path, writes):
        entry = path / name
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    return path


def written(path: str | Path, writes: tuple[str, ...]) -> list[str]:
    """The names in the folder ``path`` that ``writes`` names: after `make_folder` and the writing, what was written."""
    return _replaced(Path(path), writes)


def is_checkpoint_file(path: Path) -> bool:
    """Whether ``path`` is a Lightning checkpoint file (``trainer.save_checkpoint``, ``lit3d convert``): torch's zip
    format, whose pickle holds a ``state_dict`` key. NOTE: read with `zipfile` and `pickletools`, which run nothing."""
    if not path.is_file() or not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [name for name in archive.namelist() if name.rpartition("/")[2] == "data.pkl"]
            if len(pickles) != 1:
                return False
            with archive.open(pickles[0]) as data:
                strings = (arg for op, arg, _ in pickletools.genops(data) if "UNICODE" in op.name)
                return "state_dict" in strings
    except (OSError, ValueError, zipfile.BadZipFile):  # NOTE: a truncated pickle ends `genops` with a ValueError
        return False


def is_export_folder(path: Path) -> bool:
    """Whether ``path`` is a folder that ``lit3d export`` wrote: one of its safetensors files carries `MARK`."""
    return path.is_dir() and any(
        MARK.items() <= _safetensors_metadata(file).items() for file in path.glob("*.safetensors")
    )


def safetensors_header(file: Path) -> dict:
    """A safetensors file's header (8 bytes of length, then JSON: each tensor's dtype, shape and offsets by name, and
    ``__metadata__``), {} for a file that has none: read without torch."""
    try:
        with open(file, "rb") as opened:
            size = int.from_bytes(opened.read(8), "little")
            header = json.loads(opened.read(size)) if 0 < size <= 100_000_000 else {}
    except (OSError, ValueError):
        return {}
    return header if isinstance(header, dict) else {}


def _safetensors_metadata(file: Path) -> dict:
    """The ``__metadata__`` of a safetensors file's header, {} if it has none."""
    metadata = safetensors_header(file).get("__metadata__")
    return metadata if isinstance(metadata, dict) else {}


def _replaced(folder: Path, writes: tuple[str, ...]) -> list[str]:
    return sorted(entry.name for entry in folder.iterdir() if any(fnmatchcase(entry.name, p) for p in writes))


def _few(names: list[str]) -> str:
    if not names:
        return "nothing"
    return ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")


def _remedy(flag: str | None, count: int) -> str:
    them = "it" if count == 1 else "them"
    if flag is None:
        return f"give another path, or move {them} away"
    return f"give another path, or add {flag} to replace {them}"
