"""The configs lit3d ships: each model preset's layout is the planner's choice for the cluster its comment names, and
they come with the package (``lit3d/configs`` of the wheel: tests/test_cli.py's wheel test), found by name from any
folder: ``--config tiny``."""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lit3d.cli import main
from lit3d.shipped import shipped_configs

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
# The configs of a GPU cluster (their comments name it), as opposed to the CPU demos and the fine-tuning recipes.
CLUSTER_CONFIGS = [p.stem for p in CONFIGS if yaml.safe_load(p.read_text())["trainer"].get("accelerator") == "gpu"]
# NOTE: the search keeps the config's sizes on these axes where the whole search takes seconds on this machine
# (llama-405b on 128 GPUs: ~7 s, the MoE models over every EP size: 2-5 s); the whole one, `lit3d plan --config
# configs/NAME.yaml --search`, chooses the same (the numbers the config's comment quotes).
NARROWED = {
    "llama-70b": ("tensor",),
    "llama-405b": ("tensor",),
    "gpt3-175b": ("tensor",),
    "mixtral-8x7b": ("tensor", "expert"),
    "qwen3-30b-a3b": ("tensor", "expert"),
}


def planned(*args: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", *args, "--json"])
    return json.loads(out.getvalue())


def test_each_model_family_with_a_preset_has_a_cluster_config():
    """There was no Qwen3-MoE or Mixtral config beside moe-tiny, nor one of DeepSeek-V3's shape."""
    assert {
        "llama-8b",
        "llama-70b",
        "llama-405b",
        "gpt3-175b",
        "mixtral-8x7b",
        "qwen3-30b-a3b",
        "moonlight-16b-a3b",
    } <= set(CLUSTER_CONFIGS)


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_each_cluster_config_runs_the_planner_s_best_layout_for_its_cluster(name):
    """``configs/llama-70b.yaml`` (TP8, ZeRO-3, full recompute) planned at three quarters of the MFU of the best on the
    cluster it names. Planned as written, each config is the search's best for its model, data and cluster."""
    path = str(ROOT / "configs" / f"{name}.yaml")
    run = planned("--config", path)
    narrowed = [
        arg
        for axis in NARROWED.get(name, ())
        for arg in (f"--{axis}_parallel_size", str(run["layout"][f"{axis}_parallel_size"]))
    ]
    best = planned("--config", path, "--search", *narrowed)
    keys = ("layout", "pipeline_schedule", "num_microbatches", "memory_per_gpu", "step_time_s", "fits")
    assert {k: run[k] for k in keys} == {k: best[k] for k in keys}, name


def build_wheel(folder: Path) -> Path:
    """lit3d's wheel, built in ``folder`` from a copy of the repository's package files with this environment's
    setuptools (no network; the repository gets no build folder)."""
    source, output = folder / "source", folder / "dist"
    for name in ("pyproject.toml", "README.md"):
        source.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    for name in ("lit3d", "strategies", "configs"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(output), "."]
    run = subprocess.run(build, cwd=source, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    return next(output.glob("lit3d-*.whl"))


def test_a_shipped_config_is_found_by_name_from_any_folder(tmp_path, monkeypatch, capsys):
    """``--config configs/tiny.yaml`` failed outside a clone: ``--config tiny`` (a name that is no file) is the shipped
    config, for ``lit3d fit`` and ``lit3d plan``; a missing ``configs/tiny.yaml`` names it."""
    from lit3d.cli import make_cli

    monkeypatch.chdir(tmp_path)
    cli = make_cli(["--config", "tiny", "--trainer.logger=false"], run=False)
    assert cli.model.config.name == "tiny" and cli.datamodule.seq_len == 128
    assert planned("--config", "llama-70b")["cluster"]["nodes"] == 8
    with pytest.raises(SystemExit) as error:
        main(["fit", "--config", "configs/tiny.yaml"])
    assert str(error.value.code) == (
        "lit3d fit: error: --config configs/tiny.yaml: no such file; a config shipped with lit3d is found by its name: "
        "--config tiny"
    )


def test_fit_help_lists_the_shipped_configs(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "the name of one shipped with lit3d: " + ", ".join(shipped_configs()) + "." in help_text
    assert set(shipped_configs()) == {path.stem for path in CONFIGS}


@pytest.mark.skipif(not os.environ.get("WHEEL_TESTS"), reason="builds and installs the wheel, then trains (~30 s)")
def test_the_installed_wheel_trains_tiny_from_a_folder_that_is_not_a_clone(tmp_path):
    """``pip install`` of the wheel (into a folder of its own, no dependencies: this environment's torch and
    Lightning), then ``lit3d fit --config tiny --trainer.max_steps=5`` in an empty folder."""
    wheel = build_wheel(tmp_path)
    target, elsewhere = tmp_path / "installed", tmp_path / "elsewhere"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)]
    subprocess.run(install, check=True, timeout=240)
    elsewhere.mkdir()
    code = "import lit3d, sys; print('lit3d from', lit3d.__file__); from lit3d.cli import main; main(sys.argv[1:])"
    train = [sys.executable, "-c", code, "fit", "--config", "tiny", "--trainer.max_steps=5"]
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = subprocess.run(train, cwd=elsewhere, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"lit3d from {target}" in run.stdout and "max_steps=5` reached" in run.stdout + run.stderr
    assert (elsewhere / "runs" / "tiny" / "checkpoints" / "last.ckpt").is_file()
