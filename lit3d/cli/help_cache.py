"""The help of ``lit3d fit|validate|test|predict`` (``--help``, ``--data.help CLASS``, ...), kept to answer again.

Building that help means loading Lightning, torch and every class it describes: seconds (up to 20 on a busy machine)
for text that only changes with the code. The first answer is kept under ``$XDG_CACHE_HOME/lit3d/help`` (by default
``~/.cache/lit3d/help``), keyed by everything the text depends on: the command line, the folder it runs in, the files
it names (a ``--config``), the terminal's width, the versions of Python, lit3d, Lightning, jsonargparse and torch, and
every file of the lit3d package. A later identical request prints it without importing torch (well under a second).

Help about a class from elsewhere (``--model.help mypackage.MyModel``) is not kept: its source could change unseen.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from lit3d.shipped import configs_folder

HELP_FLAGS = ("-h", "--help")
KNOWN_CLASSES = ("lit3d.", "lightning.", "torch.", "strategies.")  # the ``.help`` classes whose source is keyed
VERSIONED = ("lit3d", "lightning", "jsonargparse", "torch")


def is_help(argv: list[str]) -> bool:
    """Whether the command line asks for help (which is all it then does)."""
    return any(arg in HELP_FLAGS or arg.partition("=")[0].endswith(".help") for arg in argv)


def cache_file(argv: list[str]) -> Path | None:
    """Where the answer to ``argv`` is kept, or None when it is not kept (help about a class from elsewhere)."""
    for i, arg in enumerate(argv):
        key, equals, value = arg.partition("=")
        if not key.endswith(".help"):
            continue
        value = value if equals else (argv[i + 1] if i + 1 < len(argv) else "")
        if "." in value and not value.startswith(KNOWN_CLASSES):
            return None
    inputs = {
        "argv": argv,
        "cwd": os.getcwd(),
        "python": sys.executable,
        "tty": sys.stdout.isatty(),
        "columns": shutil.get_terminal_size().columns,
        "colour": [os.environ.get(name) for name in ("NO_COLOR", "FORCE_COLOR", "PYTHON_COLORS")],  # argparse 3.14's
        "versions": {name: _version(name) for name in VERSIONED},
        "package": _package_state(),
        "files": [_file_state(Path(arg.partition("=")[2] or arg)) for arg in argv],
    }
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return home / "lit3d" / "help" / f"{digest}.txt"


def answer(argv: list[str], build: Callable[[], Any]) -> None:
    """Print the help ``argv`` asks for: the kept answer, or ``build()``'s (which prints it and exits), then kept."""
    path = cache_file(argv)
    if path is not None and path.is_file():
        sys.stdout.write(path.read_text(encoding="utf-8"))
        sys.stdout.flush()
        raise SystemExit(0)
    printed = io.StringIO()
    stdout, sys.stdout = sys.stdout, _Tee(sys.stdout, printed)
    try:
        build()
    except SystemExit as exit_:
        if exit_.code in (0, None) and path is not None and printed.getvalue():
            _write(path, printed.getvalue())
        raise
    finally:
        sys.stdout = stdout


def _write(path: Path, text: str) -> None:
    """Keep ``text`` at ``path`` (whole or not at all); a cache that cannot be written is only not kept."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(text, encoding="utf-8")
        partial.replace(path)
    except OSError:
        pass


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _package_state() -> list[tuple[str, int, int]]:
    """Every file of the lit3d package (``lit3d.strategies`` and the shipped configs, which ``fit --help`` lists, may
    live elsewhere in a checkout): path, mtime, size."""
    import importlib.util

    import lit3d

    spec = importlib.util.find_spec("lit3d.strategies")
    folders = {Path(lit3d.__file__).parent, configs_folder()}
    folders.update(map(Path, (spec.submodule_search_locations or []) if spec else []))
    state = []
    for folder in sorted(folders):
        for file in sorted(folder.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts:
                stat = file.stat()
                state.append((str(file), stat.st_mtime_ns, stat.st_size))
    return state


def _file_state(path: Path) -> tuple[str, int, int] | None:
    """A file a command line names (a ``--config``): its path, mtime and size; None for an argument that is not one."""
    try:
        if not path.is_file():
            return None
        stat = path.stat()
    except (OSError, ValueError):
        return None
    return str(path.resolve()), stat.st_mtime_ns, stat.st_size


class _Tee(io.TextIOBase):
    """A stdout that also keeps what is written to it."""

    def __init__(self, stream: Any, copy: io.StringIO) -> None:
        self.stream, self.copy = stream, copy

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()
