"""End-to-end runs of the `lit3d` command line: few, tiny, and checked against each other."""

import os
import re
import subprocess
import sys
from pathlib import Path

import forked
import pytest
import torch
from helpers import FORK, logged

from lit3d import GPT

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
QUICK = [
    "--trainer.max_steps=4",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_progress_bar=false",
    "--data.init_args.seq_len=32",
    "--data.init_args.global_batch_size=4",
    "--trainer.enable_checkpointing=false",
]


def lit3d(*args, cwd, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return forked.run([sys.executable, str(ROOT / "cli.py"), *args], cwd=cwd, env=env, timeout=timeout)


def fit_losses(cwd, *args):
    """The logged losses, and what the run printed."""
    run = lit3d("fit", "--config", TINY, *QUICK, *args, cwd=cwd)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.tensor(logged(cwd / "runs" / "tiny" / "version_0", "train_loss")), run.stdout + run.stderr


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory):
    losses, _ = fit_losses(tmp_path_factory.mktemp("auto"))
    assert len(losses) == 4
    return losses


@pytest.mark.ranks
def test_fit_under_ddp_gives_the_single_process_losses(tmp_path, single_process_losses):
    ddp, _ = fit_losses(tmp_path, "--trainer.devices=2", "--trainer.strategy=ddp_fork")  # (`helpers.FORK`)
    torch.testing.assert_close(ddp, single_process_losses, rtol=1e-5, atol=0)


@pytest.mark.ranks
def test_3d_auto_with_a_memory_limit_picks_a_split_layout_logs_it_and_trains_like_one_process(
    tmp_path, single_process_losses
):
    """The planner chooses at launch (tests/test_auto_layout.py: at this limit plain data parallelism fits nowhere);
    rank 0 logs the choice, why and its flags, and the run follows the one-process curve."""
    from test_auto_layout import SPLIT_ONLY_GB

    losses, printed = fit_losses(
        tmp_path,
        "--trainer.devices=4",
        "--trainer.strategy=3d_auto",
        f"--trainer.strategy.auto_memory_gb={SPLIT_ONLY_GB}",
        FORK,
    )
    torch.testing.assert_close(losses, single_process_losses, rtol=1e-5, atol=0)
    chose = next(line for line in printed.splitlines() if line.startswith("3d_auto chose: "))
    assert "tp 1 x pp 1" not in chose and "  why: " in printed and "the same run, written out: " in printed, chose
    assert re.search(r"  searched: \d+ micro-batch size\(s\) in [0-9.]+ s of CPU", printed), printed[-3000:]
    assert "plan check: peak memory" in printed, printed[-3000:]
    assert " peaked at " not in printed, printed[-3000:]  # within its plan's band and its memory (issue 63, item 4)


@pytest.mark.ranks
def test_fit_with_ckpt_path_last_starts_fresh_then_resumes_where_the_run_stopped(tmp_path, single_process_losses):
    """The same command twice, as a requeued job runs it: DP2 saving in the background into the config's fixed
    checkpoint folder (``runs/tiny/checkpoints``), stopped after step 2, then continued to step 4 from there."""
    command = [
        "fit", "--config", TINY, *QUICK, "--trainer.enable_checkpointing=true",
        "--trainer.callbacks.every_n_train_steps=2", "--trainer.devices=2", "--trainer.strategy=Parallel3DStrategy",
        "--trainer.strategy.async_checkpoint=true", "--ckpt_path=last", FORK,
    ]  # fmt: skip
    first = lit3d(*command, "--trainer.max_steps=2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "no checkpoint in" in first.stderr + first.stdout and "starting fresh" in first.stderr + first.stdout
    second = lit3d(*command, "--trainer.max_steps=4", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    folder = tmp_path / "runs" / "tiny" / "checkpoints"
    assert f"resuming from '{folder / 'last.ckpt'}'" in second.stderr + second.stdout
    resumed = torch.tensor(logged(tmp_path / "runs" / "tiny" / "version_1", "train_loss"))
    torch.testing.assert_close(resumed, single_process_losses[2:], rtol=1e-5, atol=0)
    # a checkpoint of `lit3d fit` (its hyper-parameters hold LightningCLI's `_class_path`) loads back in Python
    model = GPT.load_from_checkpoint(folder / "last.ckpt")
    assert model.global_step == 0 and model.config.name == "tiny" and model.model is not None


LAYOUT_3D = ["--trainer.devices=4", "--trainer.strategy=Parallel3DStrategy"]
# name -> (command line, environment); all run in one process (tests/cli_batch.py) and stop before training.
EARLY_EXITS = {
    "microbatches": (
        [
            "fit",
            "--config",
            TINY,
            *QUICK,
            *LAYOUT_3D,
            "--trainer.strategy.pipeline_parallel_size=2",
            "--trainer.strategy.num_microbatches=3",
        ],
        {},
    ),
    "stages": (
        [
            "fit",
            "--config",
            TINY,
            *QUICK,
            *LAYOUT_3D,
            "--trainer.strategy.pipeline_parallel_size=4",
            "--trainer.strategy.virtual_pipeline_size=2",
            "--trainer.strategy.pipeline_schedule=interleaved_1f1b",
        ],
        {},
    ),
    "no_loss_fn": (
        [
            "fit",
            "--config",
            TINY,
            *QUICK,
            *LAYOUT_3D,
            "--trainer.strategy.pipeline_parallel_size=2",
            "--model.class_path=helpers.GPTWithoutLossFn",
        ],
        {},
    ),
    "model_help": (["fit", "--model.help", "lit3d.GPT"], {}),
    "data_help": (["fit", "--data.help", "lit3d.data.TextDataModule"], {}),
    "too_long": (["fit", "--config", TINY, *QUICK, "--data.init_args.seq_len=512"], {}),
    "preset": (["fit", "--config", TINY, *QUICK, "--model.init_args.config=llama-9b"], {}),
    "missing": (["fit", "--config", TINY, *QUICK, "--data.init_args.data_path=/no/such/corpus"], {}),
    "tokenizer": (["fit", "--config", TINY, *QUICK, "--data.init_args.tokenizer=/no/such/tokenizer.json"], {}),
    "ckpt_path": (["fit", "--config", TINY, *QUICK, *LAYOUT_3D, "--ckpt_path=/no/such/step=4.ckpt"], {}),
    "help": (["--help"], {}),
    # torchrun started 4 ranks (2 nodes x 2), the config says 1 node
    "num_nodes": (
        [
            "fit",
            "--config",
            TINY,
            *QUICK,
            "--trainer.devices=2",
            "--trainer.num_nodes=1",
            "--trainer.strategy=Parallel3DStrategy",
        ],
        {
            "TORCHELASTIC_RUN_ID": "x",
            "RANK": "0",
            "LOCAL_RANK": "0",
            "GROUP_RANK": "0",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29999",
        },
    ),
}


@pytest.fixture(scope="module")
def early_exits(tmp_path_factory) -> dict[str, dict]:
    import json

    folder = tmp_path_factory.mktemp("early_exits")
    cases = [{"args": args, "env": env} for args, env in EARLY_EXITS.values()]
    (folder / "cases.json").write_text(json.dumps(cases))
    run = forked.run(
        [sys.executable, str(ROOT / "tests" / "cli_batch.py"), "cases.json", "results.json"],
        cwd=folder,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return dict(zip(EARLY_EXITS, json.loads((folder / "results.json").read_text())))


@pytest.mark.parametrize(
    "case, message",
    [
        (
            "microbatches",
            "the per-replica batch of 2 (global_batch_size=4 / (data_parallel_size=2 x "
            "accumulate_grad_batches=1)) is not divisible by num_microbatches=3",
        ),
        ("stages", "= 8 stages, but the model has only n_layer=4 blocks"),
        ("num_nodes", "`devices=2` and `num_nodes=1` ... world size (4)"),
        (
            "no_loss_fn",
            "pipeline_parallel_size=2 runs GPTWithoutLossFn's loss as a pipeline schedule, which needs "
            "inputs_and_targets, loss_fn, loss; it lacks loss_fn",
        ),
    ],
)
def test_a_bad_layout_is_refused_before_any_process_starts(early_exits, case, message):
    run = early_exits[case]
    assert run["code"] != 0
    for part in message.split(" ... "):
        assert part in run["stderr"], run["stderr"][-3000:]
    assert not run["process_group"]  # refused before any process group was formed (and no rank was launched)


def test_help_shows_arguments_with_their_docstrings(early_exits):
    assert early_exits["model_help"]["code"] == 0, early_exits["model_help"]["stderr"][-3000:]
    model_help = " ".join(early_exits["model_help"]["stdout"].split())  # undo the help's line wrapping
    assert "--model.learning_rate" in model_help and "Peak learning rate, reached after" in model_help
    data_help = " ".join(early_exits["data_help"]["stdout"].split())
    assert "Sequences per optimizer step across all data-parallel replicas" in data_help


@pytest.mark.parametrize(
    "case, message",
    [
        ("too_long", "seq_len=512 is above the model's max_seq_len=256"),
        ("preset", "unknown model preset 'llama-9b'"),
        ("missing", "data_path='/no/such/corpus' does not exist"),
        ("tokenizer", "tokenizer file '/no/such/tokenizer.json' does not exist"),
        ("ckpt_path", "ckpt_path='/no/such/step=4.ckpt' does not exist"),
    ],
)
def test_bad_input_is_refused_before_training_with_the_value_named(early_exits, case, message):
    run = early_exits[case]
    assert run["code"] != 0 and message in run["stderr"], run["stderr"][-3000:]
    assert not run["process_group"]
    assert "Traceback" not in run["stderr"]  # one message, not a chain of tracebacks


def test_help_lists_every_command(early_exits):
    assert early_exits["help"]["code"] == 0
    for command in ("fit", "validate", "test", "predict", "plan", "export", "convert", "generate", "prepare"):
        assert f"\n  {command} " in early_exits["help"]["stdout"], command


# NOTE: 30 s alone, 288 s once beside the other xdist worker's layout runs: now they take turns (tests/turns.py), and
# the longer limit covers a wait for the other worker's turn.
@pytest.mark.ranks
@pytest.mark.timeout(600)
def test_two_node_torchrun_on_loopback_keeps_tp_inside_a_node_and_pipelines_across(tmp_path, single_process_losses):
    """Tensor x pipeline parallel 2 x 2 (the strategy by its class path), launched as two `torchrun --nnodes 2`
    invocations on 127.0.0.1 (2 ranks each; the README's 2 x 2 x 2 adds data parallelism, which the layout tests
    cover): each TP group lives on one "node", each node holds one pipeline stage, and the loss curve is the
    single-process one. The model summary counts the whole model
    (Lightning's counted rank 0's pipeline stage), and rank 0's share beside it."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    nodes = [
        forked.start(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc_per_node=2",
                f"--node_rank={node}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                str(ROOT / "cli.py"),
                "fit",
                "--config",
                TINY,
                *QUICK,
                "--trainer.num_nodes=2",
                "--trainer.devices=2",
                "--trainer.strategy=lit3d.strategies.Parallel3DStrategy",
                "--trainer.strategy.tensor_parallel_size=2",
                "--trainer.strategy.pipeline_parallel_size=2",
                "--trainer.callbacks+=helpers.RecordPlacement",
            ],
            cwd=tmp_path,
            env=env,
            merge_output=True,
        )  # (torchrun's agents forked; the ranks they start are fresh processes)
        for node in (0, 1)
    ]
    codes = [p.wait(timeout=560) for p in nodes]
    outputs = [p.stdout() for p in nodes]
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    placements = [json.loads((tmp_path / f"placement_rank{r}.json").read_text()) for r in range(4)]
    assert [p["node"] for p in placements] == [0] * 2 + [1] * 2
    assert [p["stage"] for p in placements] == [p["node"] for p in placements]  # one pipeline stage a node
    for p in placements:
        assert {placements[r]["node"] for r in p["tp_group"]} == {p["node"]}  # the TP group is on its own node
    assert "2 node(s) x 2 device(s)" in outputs[0]  # the rank map printed at start shows the nodes
    assert "Total params: 853 K" in outputs[0] and "of the model's 853 K parameters" in outputs[0], outputs[0][-3000:]
    losses = torch.tensor(logged(tmp_path / "runs" / "tiny" / "version_0", "train_loss"))
    torch.testing.assert_close(losses, single_process_losses, rtol=1e-5, atol=0)


SINGLE_CALLBACK = """\
trainer:
  callbacks:
    class_path: lightning.pytorch.callbacks.ModelCheckpoint
    init_args:
      every_n_train_steps: 5
"""


@pytest.mark.parametrize("form", ["yaml_mapping", "flag", "flag_appended_to_yaml_mapping"])
def test_one_callback_in_any_form_trainer_accepts_builds_the_trainer(tmp_path, form):
    """`trainer.callbacks` may be one callback rather than a list (crashed with "'ModelCheckpoint' object is not
    iterable"); lit3d's own Throughput is still added."""
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    from lit3d.callbacks import Throughput
    from lit3d.cli import make_cli

    (tmp_path / "one.yaml").write_text(SINGLE_CALLBACK)
    args = {
        "yaml_mapping": ["--config", str(tmp_path / "one.yaml")],
        "flag": ["--trainer.callbacks=lightning.pytorch.callbacks.ModelCheckpoint"],
        "flag_appended_to_yaml_mapping": [
            "--config",
            str(tmp_path / "one.yaml"),
            "--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor",
        ],
    }[form]
    cli = make_cli([f"--trainer.default_root_dir={tmp_path}", *args], run=False)
    kinds = [type(c) for c in cli.trainer.callbacks]
    assert ModelCheckpoint in kinds and Throughput in kinds, kinds
    assert (LearningRateMonitor in kinds) == (form == "flag_appended_to_yaml_mapping"), kinds


@pytest.mark.parametrize(
    "name",
    ["3d", "Parallel3DStrategy", "lit3d.strategies.Parallel3DStrategy", "strategies.Parallel3DStrategy", "3d_auto"],
)
def test_every_documented_strategy_name_resolves_when_installed(monkeypatch, tmp_path, name):
    """The installed package has no top-level `strategies`; lit3d 0.1's class path still works in the CLI."""
    import importlib.util

    from lit3d import Parallel3DStrategy  # the top-level name, too
    from lit3d.cli import make_cli

    monkeypatch.chdir(tmp_path)  # LightningCLI saves its config.yaml here
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "strategies" else find_spec(n, *a))
    monkeypatch.delitem(sys.modules, "strategies", raising=False)
    plain = make_cli(["--trainer.logger=false", f"--trainer.strategy={name}"], run=False)
    with_arguments = make_cli(["--trainer.logger=false", f"--trainer.strategy={name}",
                               "--trainer.strategy.zero_stage=0"], run=False)  # fmt: skip
    assert type(plain.trainer.strategy) is type(with_arguments.trainer.strategy) is Parallel3DStrategy
    assert with_arguments.trainer.strategy.parallelism.zero_stage == 0
    auto = name == "3d_auto"  # the planner chooses the layout at launch
    assert (
        plain.trainer.strategy.parallelism.auto_layout
        is with_arguments.trainer.strategy.parallelism.auto_layout
        is auto
    )


def test_the_wheel_installs_lit3d_alone_at_the_top_level(tmp_path):
    """`pip install .` puts nothing but `lit3d` (and its metadata) into site-packages: `strategies/` is
    `lit3d.strategies`, `cli.py` is `lit3d.cli`, the console script points into the package, and every config of
    `configs/` is `lit3d/configs/NAME.yaml` (after `pip install lit3d` there were none: `--config tiny` finds them)."""
    import shutil
    import zipfile

    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "cli.py"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("lit3d", "strategies", "configs"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("lit3d-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"lit3d", wheel.name.split("-py")[0] + ".dist-info"}
    assert {"lit3d/strategies/parallel3d.py", "lit3d/cli/__init__.py", "lit3d/planner/estimate.py"} <= set(names)
    assert {f"lit3d/configs/{path.name}" for path in (ROOT / "configs").glob("*.yaml")} <= set(names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "lit3d = lit3d.cli:main" in entry_points


def test_without_a_logger_the_learning_rate_monitor_is_left_out_with_a_warning(monkeypatch, tmp_path):
    """The tiny config's LearningRateMonitor crashed a run with `--trainer.logger=false`."""
    from lightning.pytorch.callbacks import LearningRateMonitor

    from lit3d.cli import make_cli

    monkeypatch.chdir(tmp_path)  # LightningCLI saves its config.yaml here
    with pytest.warns(UserWarning, match="LearningRateMonitor callback has nowhere to log"):
        cli = make_cli(["--config", TINY, "--trainer.logger=false"], run=False)
    assert not any(isinstance(c, LearningRateMonitor) for c in cli.trainer.callbacks)
