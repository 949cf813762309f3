"""The ``lit3d fit`` configs shipped with lit3d: the repository's ``configs/`` folder, installed as ``lit3d/configs``
(pyproject.toml's package-dir), so that ``--config tiny`` works after ``pip install lit3d`` from any folder."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def configs_folder() -> Path:
    """Where the shipped configs are: ``lit3d/configs`` of an installed wheel, or ``configs/`` of a checkout."""
    installed = HERE / "configs"
    return installed if installed.is_dir() else HERE.parent / "configs"


def shipped_configs() -> list[str]:
    """The names of the shipped configs (``tiny``, ``llama-70b``, ...)."""
    return sorted(path.stem for path in configs_folder().glob("*.yaml"))


def find_config(spec: str) -> Path | None:
    """The config ``spec`` names: a file, else a shipped config by name (``tiny``, ``tiny.yaml``); None if neither."""
    if Path(spec).is_file():
        return Path(spec)
    if "/" in spec or "\\" in spec:  # a path that is not there
        return None
    shipped = configs_folder() / (spec if spec.endswith((".yaml", ".yml")) else f"{spec}.yaml")
    return shipped if shipped.is_file() else None
