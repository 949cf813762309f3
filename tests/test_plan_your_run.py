"""``lit3d plan`` plans the run you are about to launch: a ``lit3d fit`` config (``--config``), a HuggingFace folder or
its ``config.json`` (``--model``), and prints the whole ``lit3d fit`` command of the plan it shows, which plans back to
the same numbers; when nothing fits, the nearest miss and what it lacks."""

import contextlib
import io
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lit3d.cli import main
from lit3d.hf.config import read_config

ROOT = Path(__file__).resolve().parents[1]
LLAMA_70B = str(ROOT / "configs" / "llama-70b.yaml")
# A tiny Qwen3 folder's config.json (what `save_pretrained` writes; the planner reads nothing else of a folder).
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def planned(*args: str) -> dict:
    """``lit3d plan ARGS --json``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", *args, "--json"])
    return json.loads(out.getvalue())


def same_run(a: dict, b: dict) -> bool:
    keys = ("layout", "pipeline_schedule", "num_microbatches", "memory_per_gpu", "step_time_s", "params_total")
    return all(a[key] == b[key] for key in keys) and a["cluster"] == b["cluster"]


def test_a_fit_config_is_planned_as_the_run_it_describes():
    """Its model, data, devices, nodes, precision and strategy: the same plan as every flag given by hand. It was
    refused (``Parser key "model": Expected a <class 'str'>``)."""
    by_hand = planned(
        "--model",
        "llama-70b",
        "--nodes",
        "8",
        "--gpus_per_node",
        "8",
        "--seq_len",
        "4096",
        "--global_batch_size",
        "256",
        "--precision",
        "bf16-mixed",
        "--tensor_parallel_size",
        "4",
        "--pipeline_parallel_size",
        "4",
        "--zero_stage",
        "2",
        "--sequence_parallel",
        "true",
        "--pipeline_schedule",
        "1f1b",
        "--num_microbatches",
        "64",
        "--activation_checkpointing",
        "false",
    )
    assert same_run(planned("--config", LLAMA_70B), by_hand)
    overridden = planned("--config", LLAMA_70B, "--zero_stage", "1", "--precision", "bf16-true")
    assert overridden["layout"]["zero_stage"] == 1 and overridden["layout"]["tensor_parallel_size"] == 4
    assert overridden["memory_per_gpu"]["optimizer"] < by_hand["memory_per_gpu"]["optimizer"]


def test_a_config_s_micro_batches_are_the_run_s(tmp_path):
    """The data module's micro-batch (global batch / (replicas x accumulate_grad_batches)) without a pipeline; with
    one, the strategy's own count per schedule. A DDP run is ZeRO-0, a CPU run is planned on CPU processes."""
    config = {
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "precision": "32",
            "accumulate_grad_batches": 2,
            "strategy": "ddp",
        },
        "model": {"class_path": "lit3d.GPT", "init_args": {"config": "tiny"}},
        "data": {"class_path": "lit3d.data.TextDataModule", "init_args": {"seq_len": 128, "global_batch_size": 16}},
    }
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(config))
    run = planned("--config", str(path))
    assert run["layout"]["data_parallel_size"] == 2 and run["layout"]["zero_stage"] == 0
    assert run["num_microbatches"] == 2 and run["cluster"]["device"] == "CPU process"  # 16 / (2 x 2) = 4 per micro-step
    assert (
        run["activation_bytes_per_layer"]
        == planned("--config", str(path), "--micro_batch_size", "4")["activation_bytes_per_layer"]
    )
    pipelined = planned("--config", str(path), "--pipeline_parallel_size", "2")  # the strategy's default: 2 x pp
    assert pipelined["layout"]["data_parallel_size"] == 1 and pipelined["num_microbatches"] == 4


def test_a_fit_config_given_as_the_model_is_refused_with_the_flag_that_plans_it():
    """It crashed with ``GPTConfig.__init__() got an unexpected keyword argument 'seed_everything'``."""
    with pytest.raises(SystemExit) as error:
        main(["plan", "--model", LLAMA_70B])
    assert str(error.value.code) == (
        f"lit3d plan: error: {LLAMA_70B} is a `lit3d fit` config, not a model's fields: plan its run with --config "
        f"{LLAMA_70B}"
    )


@pytest.mark.parametrize("given", ["folder", "config.json"])
def test_a_huggingface_folder_or_its_config_json_is_planned_as_its_model(given, tmp_path, capsys):
    """It was an "unknown model preset". The model is the folder's as `GPT.from_pretrained` reads it, and the command
    printed fine-tunes the folder."""
    folder = tmp_path / "my-qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_QWEN3))
    model = str(folder if given == "folder" else folder / "config.json")
    run = planned("--model", model, "--gpus_per_node", "2", "--gpu", "CPU", "--seq_len", "256")
    assert run["model"] == "my-qwen" and run["params_total"] == read_config(folder).num_params
    main(["plan", "--model", model, "--gpus_per_node", "2", "--gpu", "CPU", "--seq_len", "256"])
    out = capsys.readouterr().out
    assert out.startswith("lit3d plan: my-qwen (") and f"--model.pretrained={folder} " in out.splitlines()[-1]


def test_a_missing_model_path_is_named():
    with pytest.raises(SystemExit) as error:
        main(["plan", "--model", "my-qwen/"])
    assert "model='my-qwen/': no such file or folder" in str(error.value.code)


def printed_command(*args: str) -> list[str]:
    """The ``lit3d fit`` command that ``lit3d plan ARGS`` prints for its best layout, as arguments after ``fit``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", *args])
    line = out.getvalue().splitlines()[-1]
    assert line.startswith(("run the best with: lit3d fit ", "run it with: lit3d fit ")), line
    return shlex.split(line.partition(" with: ")[2])[2:]


def fit_config(argv: list[str], folder: Path) -> str:
    """The config ``lit3d fit ARGV`` runs, as ``--print_config`` writes it, in a file."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["fit", *argv, "--print_config"])
    path = folder / "printed.yaml"
    path.write_text(out.getvalue())
    return str(path)


@pytest.mark.parametrize(
    "plan",
    [
        ("--model", "llama-8b", "--seq_len", "8192", "--global_batch_size", "32"),  # TP2 x DP4, 8 micro-steps
        (
            "--model",
            "llama-70b",
            "--nodes",
            "8",
            "--seq_len",
            "4096",
            "--global_batch_size",
            "256",
            "--tensor_parallel_size",
            "4",
        ),  # a pipeline: its schedule and micro-batches
        ("--config", LLAMA_70B, "--search", "--tensor_parallel_size", "8"),  # all the config writes, overridden
        ("--config", LLAMA_70B, "--tensor_parallel_size", "8", "--pipeline_parallel_size", "4"),  # "run it with:"
    ],
)
def test_the_command_printed_runs_the_plan_shown(plan, tmp_path):
    """ "run the best with:" omitted the nodes, devices, model and precision (``lit3d fit ...``): the whole command,
    as ``lit3d fit`` reads it, plans back to the best layout's numbers."""
    best = planned(*plan)
    run = planned("--config", fit_config(printed_command(*plan), tmp_path))
    assert same_run(run, best), (run, best)


def test_when_nothing_fits_the_nearest_miss_is_named_with_what_it_lacks(capsys):
    """It said only "add GPUs": the layout that needs the least memory of those dropped, and by how much."""
    from lit3d.models.config import GPTConfig
    from lit3d.planner import Cluster, Training, search

    main(["plan", "--model", "llama-70b", "--nodes", "1", "--seq_len", "4096", "--global_batch_size", "64"])
    lines = capsys.readouterr().out.splitlines()
    miss = lines.index(next(line for line in lines if line.startswith("nearest miss: ")))
    assert lines[miss].startswith("nearest miss: dp 8 x tp 1 x pp 1, ZeRO-3")
    assert lines[miss + 1].endswith("GB short") and lines[-1].startswith("nothing fits")
    run = planned("--model", "llama-70b", "--nodes", "1", "--seq_len", "4096", "--global_batch_size", "64")
    misses = []
    fitting, _ = search(GPTConfig.from_name("llama-70b"), Cluster(), Training(4096, 1, 64), misses=misses)
    assert not fitting and run["layout"] is None
    assert run["nearest_miss"]["memory_per_gpu"]["total"] == min(c.plan.memory_per_gpu["total"] for c in misses)


def test_planning_a_config_or_a_folder_imports_neither_torch_nor_lightning(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3))
    code = (
        "import json, sys\nfrom lit3d.cli import main\n"
        f"main(['plan', '--config', {LLAMA_70B!r}])\n"
        f"main(['plan', '--model', {str(tmp_path)!r}, '--gpus_per_node', '2'])\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    modules = set(json.loads(run.stdout.splitlines()[-1]))
    assert (
        "run it with: lit3d fit --config" in run.stdout
        and "run the best with: lit3d fit --model.pretrained" in run.stdout
    )
    assert not modules & {"torch", "lightning", "pytorch_lightning", "lightning_fabric"}
