"""The prototype notebook runs headless from top to bottom: planner, rank map, 4 forked CPU ranks, loss plot; the run
is the one its plan describes."""

import contextlib
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient", reason="nbclient is in the test extra")
import nbformat  # noqa: E402
from helpers import logged  # noqa: E402
from turns import turn  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "prototype.ipynb"


def test_prototype_notebook_runs_without_error(tmp_path, monkeypatch, request):
    monkeypatch.setenv("LIT3D_NOTEBOOK_STEPS", "4")
    monkeypatch.setenv("LIT3D_NOTEBOOK_PROCESSES", "4")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    held, fits = contextlib.ExitStack(), []

    def starting(cell, **_):  # the cell that forks the ranks holds the machine's turn while it runs (`turns`)
        if "trainer.fit(" in cell.source:
            fits.append(held.enter_context(turn(request.node.nodeid)))

    with held:
        nbclient.NotebookClient(
            notebook,
            timeout=240,
            kernel_name="python3",
            resources={"metadata": {"path": str(tmp_path)}},
            on_cell_execute=starting,
            on_cell_executed=lambda **_: held.close(),
        ).execute()  # raises on any error
    assert len(fits) == 1  # (the training cell held the turn)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/svg+xml" in o.get("data", {}) for o in outputs) == 2  # the two rank maps
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the loss curve
    text = "".join(o.get("text", "") for o in outputs)
    assert "layout(s) fit" in text and "train_loss" in text
    assert "853.1K parameters) on 1 node(s) x 4 CPU processes" in text and "0.00 GB" not in text  # units by size
    cpu_line = next(line for line in text.splitlines() if "x 4 CPU processes (" in line)
    assert float(cpu_line.split(" TFLOP/s")[0].rsplit(" ", 1)[-1]) < 1  # a CPU's peak, not an H100's 989
    # Issue 63, item 3: the plan printed beside the run is the run: its layout, ZeRO stage, schedule, micro-batches.
    planned = next(line for line in text.splitlines() if line.startswith("planned: ")).removeprefix("planned: ")
    ran = next(line for line in text.splitlines() if line.startswith("ran: ")).removeprefix("ran: ").strip()
    grid, zero, precision, *rest = planned.split(", ")
    schedule, microbatches = rest[-2], rest[-1].split(" micro-batch(es)")[0]
    assert ran == f"{grid}, {zero}, {schedule}, {microbatches} micro-batch(es)", (planned, ran)
    assert grid == "dp 1 x tp 2 x pp 2" and zero == "ZeRO-1", planned
    losses = logged(tmp_path / "runs" / "notebook" / "prototype", "train_loss")
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_the_notebook_extra_installs_what_runs_it_headless():
    import tomllib

    extras = tomllib.loads((NOTEBOOK.parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {requirement.split(">")[0].split("=")[0].strip() for requirement in extras["notebook"]}
    assert {"ipykernel", "matplotlib", "nbclient", "nbformat", "nbconvert"} <= names, names
