"""On a GPU: `benchmarks/gpu_check.py`'s dry run goes the GPU run's way on CPU and prints every row of its table with
nothing failed (so the script cannot rot while no GPU is at hand), and the card names PyTorch reports map to lit3d's
hardware table, or are named when they do not."""

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.gpu_table import EXTRA_ROWS, FP8_ROWS, PEER_ROWS, PLANNER_ROWS
from lit3d.planner.hardware import identify, unknown_device

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "benchmarks" / "gpu_check.py")

# As `torch.cuda.get_device_name()` reports each card (seen in public logs and code), and its row in lit3d's table.
DEVICE_NAMES = {
    "NVIDIA H100 80GB HBM3": "H100",
    "NVIDIA H100 PCIe": "H100 PCIe",
    "NVIDIA H100 NVL": "H100 NVL",
    "NVIDIA H800": "H800",
    "NVIDIA H200": "H200",
    "NVIDIA H200 NVL": "H200 NVL",
    "NVIDIA GH200 480GB": "GH200",
    "NVIDIA A100-SXM4-80GB": "A100",
    "NVIDIA A100 80GB PCIe": "A100",
    "NVIDIA A100-SXM4-40GB": "A100 40GB",
    "NVIDIA A100-PCIE-40GB": "A100 40GB",
    "NVIDIA L40S": "L40S",
    "NVIDIA A10G": "A10G",
    "NVIDIA B200": "B200",
    "NVIDIA GB200": "GB200",
    "AMD Instinct MI300X": "MI300X",
    "AMD Instinct MI300X VF": "MI300X",
}


def test_the_card_names_pytorch_reports_map_to_the_hardware_table():
    assert {name: identify(name).name for name in DEVICE_NAMES} == DEVICE_NAMES


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090", "NVIDIA L40", "Tesla V100-SXM2-16GB"])
def test_a_card_the_table_lacks_is_named_by_the_planner(name):
    from lit3d.cli.plan_command import command_line

    assert identify(name) is None and repr(name) in unknown_device(name)
    with pytest.raises(ValueError, match=f"gpu='{name}' is not one of .*H100.*nor a device name"):
        command_line(
            ["--model", "llama3.2-1b", "--gpu", name, *"--tensor_parallel_size 1 --pipeline_parallel_size 1".split()]
        )


def test_lit3d_plan_takes_the_card_as_pytorch_names_it(capsys):
    from lit3d.cli.plan_command import command_line

    command_line(
        shlex.split(
            '--model llama3.2-1b --gpu "NVIDIA H100 NVL" --gpus_per_node 1 --seq_len 2048 '
            "--micro_batch_size 4 --global_batch_size 4 --tensor_parallel_size 1 "
            "--pipeline_parallel_size 1 --zero_stage 0 --json true"
        )
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["cluster"]["gpu"]["name"] == "H100 NVL" and plan["cluster"]["gpu_memory_gb"] == 100.0


def run_check(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The script run from an empty folder with its temporary files in another: both must stay empty."""
    cwd, tmp, output = tmp_path / "cwd", tmp_path / "tmp", tmp_path / "out"
    cwd.mkdir(), tmp.mkdir()
    environment = {**os.environ, "TMPDIR": str(tmp)}
    run = subprocess.run(
        [sys.executable, SCRIPT, "--output", str(output), *flags],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=280,
    )
    log = (output / "gpu_check.log").read_text() if (output / "gpu_check.log").exists() else ""
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:] + log[-6000:]
    assert not any(cwd.iterdir()) and not any(tmp.iterdir()), "it wrote outside its output folder"
    assert sorted(p.name for p in output.iterdir()) == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]
    assert (output / "gpu_check.md").read_text() in run.stdout
    return run, json.loads((output / "gpu_check.json").read_text())


def test_the_dry_run_prints_every_row_of_the_table_and_fails_nothing(tmp_path):
    run, results = run_check(tmp_path, "--dry-run")
    labels = [label for rows in (PEER_ROWS, PLANNER_ROWS, EXTRA_ROWS) for _, label in rows]
    assert all(f"| {label} |" in run.stdout for label in labels), run.stdout
    assert (
        run.stdout.count("| Parallel3DStrategy 1x1x1 | ") == 2
        and "| tiny-wide (d_model 128, 2 blocks) | bf16 |" in run.stdout
    )
    assert all(f"| tiny | {recipe} |" in run.stdout for _, recipe in FP8_ROWS[3:])
    assert [row["met"] for row in results["targets"]] == [None] * 9 and run.stdout.count("n/a (dry run)") == 9
    assert results["environment"]["device"].startswith("CPU") and results["commit"]
    for name in ("peers", "extras", "fp8", "planner"):
        section = results["sections"][name]
        assert section.get("done", name == "planner") and "error" not in section and "skipped" not in section, section
        for item, value in section["items"].items():
            rowwise_on_an_old_cpu = item.endswith("rowwise") and "CPU FP8 matmul" in value.get("skipped", "")
            assert rowwise_on_an_old_cpu or not {"error", "skipped"} & set(value), (name, item, value)
    peers = results["sections"]["peers"]["items"]
    assert set(peers) == {f"{system} {on}" for system, _ in PEER_ROWS for on in ("eager", "compile")}
    assert all(value["tokens_per_s"] > 0 and value["micro_batch"] == 2 for value in peers.values())
    extras = results["sections"]["extras"]["items"]
    assert extras["resume"]["max_difference"] <= 1e-4 and "printed" in extras["generate"]
    plans = results["sections"]["planner"]["items"]
    assert all(plans[item]["step_s"] > 0 and "--gpu CPU" in plans[item]["command"] for item, _ in PLANNER_ROWS)


def test_what_the_time_budget_leaves_no_room_for_is_skipped_with_a_note(tmp_path):
    run, results = run_check(tmp_path, "--dry-run", "--budget-s", "1")
    assert all(
        "s left of the 1 s budget" in results["sections"][name]["skipped"] for name in ("peers", "extras", "fp8")
    )
    assert "the peers section measured nothing to plan" in run.stdout
    assert all(f"| {label} | not run |" in run.stdout for _, label in EXTRA_ROWS)


def test_the_end_of_the_budget_skips_what_is_left_or_ends_the_section_and_the_table_is_written(tmp_path):
    """7 s for the peers: its process skips the runs it has no time left for, or the budget's end kills it (and what
    it started), whatever it was doing (importing torch, compiling, training); the table is written all the same."""
    began = time.time()
    command = [
        sys.executable,
        SCRIPT,
        "--output",
        str(tmp_path),
        "--dry-run",
        "--sections",
        "peers",
        "--budget-s",
        "12",
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    peers = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["peers"]
    ended = "ended at the end of the time budget" in peers.get("skipped", "") + peers.get("error", "")
    skipped = [item for item, value in peers.get("items", {}).items() if "s left of the time budget" in str(value)]
    assert ended or (peers["done"] and skipped), peers
    assert time.time() - began < 60 and all(f"| {label} |" in run.stdout for _, label in PEER_ROWS)


def test_a_run_no_longer_than_the_step_timers_warm_up_is_written_without_a_median(tmp_path):
    """The resume of `gpu_check.py` on a GPU trains 3 steps after a warm-up of 3: the timer writes what it has."""
    from types import SimpleNamespace

    import torch

    from benchmarks.step_timer import StepTimer

    path = tmp_path / "timer.json"
    timer = StepTimer(str(path), warmup=3)
    timer.times = [0.5, 0.25]
    strategy = SimpleNamespace(reduce=lambda tensor, reduce_op: tensor)
    trainer = SimpleNamespace(strategy=strategy, is_global_zero=True)
    timer.on_train_end(trainer, SimpleNamespace(device=torch.device("cpu")))
    assert json.loads(path.read_text())["median_step_s"] is None and json.loads(path.read_text())["steps"] == 0
