"""The compatibility legs of `.ci/run`: on the oldest and the newest PyTorch lit3d supports (``pyproject.toml``), the
layouts of every axis follow one process, a checkpoint resumes in another layout, FP8 and LoRA train, the bytes each
axis sends are the planner's, and the command line's demo runs, in a few minutes on 2 cores.

Not collected by the suite (its name is no ``test_*.py``): the suite's `layout_runs` run all of these and more on the
pinned PyTorch. The legs name it: ``python -m pytest tests/torch_range.py``.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from float8_layouts import FLOAT8_LAYOUTS, FP8_JOB, ROWWISE, TENSORWISE
from layouts import (
    COMM_MEASURED,
    CP_LAYOUTS,
    DEEP,
    HALF,
    LAYOUTS,
    LONG,
    LORA,
    LORA_LAYOUTS,
    MOE_LAYOUTS,
    SMALL_MOE,
    STEPS,
    merge,
    pp,
)
from spawned import run_jobs
from test_cli import fit_losses

REFERENCES = {  # the single-process runs, by name
    "dense": {},
    "deep": DEEP,  # the 4 blocks a V-shaped schedule's 4 stages need
    "moe": {"model": {"config": SMALL_MOE}},
    "long": LONG,
    "lora": LORA,
    "fp8_tensorwise": {**FP8_JOB, "strategy": TENSORWISE},
    "fp8_rowwise": {**FP8_JOB, "strategy": ROWWISE},
}
FOLLOWS = {  # layout -> the reference it follows: data, tensor, pipeline (1F1B and a V), context and expert parallel
    **dict.fromkeys(["dp2_zero0", "dp2_zero1", "dp2_zero3", "tp2_sequence_parallel", "pp2_1f1b"], "dense"),
    "pp2_zbv": "deep",
    **dict.fromkeys(["tp2_pp2_sequence_parallel", "dp2_pp2_zero3"], "dense"),
    "cp2": "long",
    "moe_ep2": "moe",
    "lora_tp2": "lora",
    "fp8_tp2_sequence_parallel": "fp8_tensorwise",
    "fp8_rowwise_tp2_sequence_parallel": "fp8_rowwise",
}
RESUMED = {  # resumed from another layout's checkpoint of step `HALF` -> (the layout that saved it, the reference)
    "lora_pp2_resumed_from_tp2": ("lora_tp2", "lora"),
    "tp2_pp2_resumed_from_dp2_zero3": ("dp2_zero3", "dense"),
}
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(900)  # the first test waits for `runs` (about 2 minutes on 2 idle cores)


@pytest.fixture(scope="module")
def runs(base_job, tmp_path_factory) -> dict[str, dict]:
    """Every run above: one spawn per world size (FP8 in torchao's emulated matmuls: row-wise on every release)."""
    out = tmp_path_factory.mktemp("torch_range")
    every = {**LAYOUTS, **MOE_LAYOUTS, **CP_LAYOUTS, **LORA_LAYOUTS, **FLOAT8_LAYOUTS}
    layouts = {name: every[name] for name in [*FOLLOWS, "lora_pp2_resumed_from_tp2"]}
    layouts["dp2_zero3"] = (2, merge(layouts["dp2_zero3"][1], {"checkpoint_at": HALF}))
    saved = out / "world2" / "dp2_zero3" / "ckpts" / f"step={HALF}.ckpt"
    layouts["tp2_pp2_resumed_from_dp2_zero3"] = (
        4,
        {"strategy": pp(2, tensor_parallel_size=2), "ckpt_path": str(saved)},
    )
    references = {name: merge(base_job, job) for name, job in REFERENCES.items()}
    results = run_jobs(1, references, out / "world1")
    for world in sorted({w for w, _ in layouts.values()}):
        jobs = {name: merge(base_job, job) for name, (w, job) in layouts.items() if w == world}
        results.update(run_jobs(world, jobs, out / f"world{world}"))
    return results


def largest_difference(run: list[float], reference: list[float]) -> float:
    assert len(run) == len(reference) > 0
    return max(abs(a - b) / abs(b) for a, b in zip(run, reference))


@pytest.mark.parametrize("layout", FOLLOWS)
def test_each_layout_follows_its_single_process_run(layout, runs):
    """fp32 within 1e-5 (losses and val losses), FP8 within 1e-2 (its dynamic scales follow each layout's rounding)."""
    run, reference = runs[layout], runs[FOLLOWS[layout]]
    # it learns, so the curves are worth comparing (LoRA's adapters, from B = 0, by 0.097 over these steps)
    assert reference["losses"][-1] < reference["losses"][0] - 0.05
    if layout.startswith("fp8"):
        assert largest_difference(run["losses"], reference["losses"]) <= 1e-2
        return
    for key in ("losses", "val_loss"):
        assert largest_difference(run[key], reference[key]) <= 1e-5, key


@pytest.mark.parametrize("layout", RESUMED)
def test_a_checkpoint_resumes_in_another_layout_on_the_same_curve(layout, runs):
    saved_by, reference = RESUMED[layout]
    assert len(runs[saved_by]["losses"]) == STEPS
    assert largest_difference(runs[layout]["losses"], runs[reference]["losses"][HALF:]) <= 1e-5


MEASURED = [name for name in FOLLOWS if name in COMM_MEASURED or name in CP_LAYOUTS]  # (those measure a step)


@pytest.mark.parametrize("layout", MEASURED)
def test_each_axis_sends_what_the_planner_counts(layout, runs):
    """The bytes of one step per axis, counted by the collectives' names (which differ between PyTorch releases)."""
    measured, planned = runs[layout]["comm_bytes"]["measured"], runs[layout]["comm_bytes"]["planned"]
    assert sum(planned.values()) > 0
    for axis in ("dp", "tp", "pp", "cp"):
        assert planned[axis] <= measured[axis] <= planned[axis] + 256, (axis, measured, planned)


def test_the_command_line_demo_trains_as_one_process_under_tp2_pp2(tmp_path):
    """``lit3d fit --config configs/tiny.yaml`` for 4 steps, on one process and on 4 (TP2 x PP2)."""
    tp2_pp2 = ["--trainer.devices=4", "--trainer.strategy=3d"]
    tp2_pp2 += ["--trainer.strategy.tensor_parallel_size=2", "--trainer.strategy.pipeline_parallel_size=2"]
    losses = {}
    for name, arguments in {"one": [], "tp2_pp2": tp2_pp2}.items():
        (tmp_path / name).mkdir()
        losses[name], _ = fit_losses(tmp_path / name, *arguments)
    assert len(losses["one"]) == 4
    torch.testing.assert_close(losses["tp2_pp2"], losses["one"], rtol=1e-5, atol=0)


def test_installing_lit3d_keeps_this_torch():
    """What ``pip install -e .[test]`` would install here, over this supported torch: never another torch (a GPU
    node's image holds its own CUDA build). lit3d's metadata is built by this environment's setuptools."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", "--no-build-isolation"]
    run = subprocess.run([*command, "-e", f"{ROOT}[test]"], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    installs = {p["metadata"]["name"]: p["metadata"]["version"] for p in json.loads(run.stdout)["install"]}
    assert "torch" not in installs, f"installing lit3d would replace torch {torch.__version__} by {installs['torch']}"
