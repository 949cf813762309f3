"""No command loses a file lit3d did not write (issue 63, items 1 and 2; the rule is `lit3d.outputs`): a user's file
planted where each writing command writes is refused before any work, naming it; ``--overwrite`` replaces it; what
lit3d wrote there itself is replaced again unasked (but a prepared corpus: `lit3d.data.prepared.prepared_output`).
Fit's folders: tests/test_single_file.py (`test_a_folder_lit3d_did_not_write_is_never_replaced`)."""

import json
from pathlib import Path

import pytest
import torch

from lit3d import GPT, GPTConfig
from lit3d.cli import main
from lit3d.strategies import Parallel3DStrategy


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny byte-level run as one Lightning checkpoint file (what export reads)."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, d_ff=32, vocab_size=256, max_seq_len=32))
    model.configure_model()
    path = tmp_path_factory.mktemp("run") / "run.ckpt"
    torch.save({"hyper_parameters": dict(model.hparams), "state_dict": model.state_dict(),
                "datamodule_hyper_parameters": {"tokenizer": "byte"}}, path)  # fmt: skip
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A sharded checkpoint folder (what convert reads)."""
    path = tmp_path_factory.mktemp("sharded") / "step=1.ckpt"
    Parallel3DStrategy().save_checkpoint({"state_dict": {"w": torch.ones(3)}, "optimizer_states": [], "epoch": 0}, path)
    return path


def refused(args: list[str], *names: str) -> str:
    with pytest.raises(SystemExit) as error:
        main(args)
    message = str(error.value)
    assert all(name in message for name in names) and "--overwrite" in message, message
    return message


def test_export_keeps_a_users_config_json_and_lists_only_what_it_wrote(checkpoint, tmp_path, capsys):
    mine = tmp_path / "myexport"
    mine.mkdir()
    (mine / "config.json").write_text("my config")
    (mine / "results.txt").write_text("my results")
    export = ["export", "--ckpt_path", str(checkpoint), "--output", str(mine)]
    refused(export, "config.json", "myexport")
    assert (mine / "config.json").read_text() == "my config" and sorted(p.name for p in mine.iterdir()) == [
        "config.json",
        "results.txt",
    ]
    (mine / "config.json").unlink()  # beside the user's other files: written, and only its own files listed
    main(export)
    wrote = capsys.readouterr().out.splitlines()[0]
    assert "config.json, model.safetensors" in wrote and "results.txt" not in wrote
    assert (mine / "results.txt").read_text() == "my results"


def test_export_replaces_its_own_folder_and_a_users_file_with_overwrite(checkpoint, tmp_path, capsys):
    out = tmp_path / "hf"
    export = ["export", "--ckpt_path", str(checkpoint), "--output", str(out)]
    main(export)
    main(export)  # its own folder (its weights carry lit3d's mark): replaced unasked, its files with it
    (out / "config.json").write_text("edited")
    main(export)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    user = tmp_path / "user"
    user.mkdir()
    (user / "tokenizer.json").write_text("mine")
    refused(export[:-1] + [str(user)], "tokenizer.json")
    capsys.readouterr()
    main([*export[:-1], str(user), "--overwrite"])
    assert json.loads((user / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert "tokenizer.json" in capsys.readouterr().out.splitlines()[0]


def test_convert_refuses_a_users_file_and_replaces_a_checkpoint(folder, tmp_path):
    mine = tmp_path / "mymodel.ckpt"
    mine.write_text("my model")
    convert = ["convert", "--ckpt_path", str(folder), "--output", str(mine)]
    refused(convert, "mymodel.ckpt")
    assert mine.read_text() == "my model"
    main([*convert, "--overwrite"])
    assert torch.equal(torch.load(mine)["state_dict"]["w"], torch.ones(3))
    main(convert)  # a checkpoint file: replaced unasked
    with pytest.raises(SystemExit, match="is a directory lit3d did not write"):  # never a folder, not even with it
        main(["convert", "--ckpt_path", str(folder), "--output", str(tmp_path), "--overwrite"])


def test_prepare_refuses_a_folder_holding_a_users_file(text_folder, tmp_path):
    out = tmp_path / "prepared"
    out.mkdir()
    (out / "index.json").write_text("mine")
    prepare = ["prepare", "--data_path", str(text_folder), "--output", str(out), "--num_proc", "1"]
    refused(prepare, "index.json")
    assert (out / "index.json").read_text() == "mine"
    main([*prepare, "--overwrite"])
    assert json.loads((out / "index.json").read_text())["format"] == "lit3d-tokens"


def test_calibrate_refuses_a_users_file_before_measuring(tmp_path, monkeypatch):
    from lit3d.cli import commands

    gpu = {"peak_tflops": 0.1, "memory_bandwidth_gbps": 10.0, "intra_node_gbps": 1.0, "efficiency": {}}
    profile = {"gpu": gpu | {"efficiency": {"kernel_overhead_us": 5.0}}, "collective_latency_us": 9.0, "processes": 1}
    measured = []
    monkeypatch.setattr(commands, "measure", lambda processes: measured.append(processes) or profile)
    mine = tmp_path / "cpu.json"
    mine.write_text('{"my": "settings"}')
    refused(["calibrate", "--output", str(mine)], "cpu.json")
    assert mine.read_text() == '{"my": "settings"}' and measured == []  # refused before the ~10 s of measuring
    main(["calibrate", "--output", str(mine), "--overwrite"])
    main(["calibrate", "--output", str(mine)])  # its own profile: replaced unasked
    assert json.loads(mine.read_text()) == profile and measured == [1, 1]


def test_plan_html_refuses_a_users_file(tmp_path):
    mine = tmp_path / "plan.html"
    mine.write_text("<html>my notes</html>")
    plan = ["plan", "--model", "tiny", "--nodes", "1", "--gpus_per_node", "2", "--html", str(mine)]
    refused(plan, "plan.html")
    assert mine.read_text() == "<html>my notes</html>"
    main([*plan, "--overwrite"])
    main(plan)  # its own page: replaced unasked
    assert "<title>lit3d plan: tiny" in mine.read_text()


@pytest.mark.parametrize("distributed", [True, False], ids=["sharded", "single_file"])
def test_fit_refuses_a_users_file_at_a_checkpoint_path_and_replaces_a_checkpoint(tmp_path, distributed):
    strategy = Parallel3DStrategy(save_distributed_checkpoint=distributed)
    checkpoint = {"state_dict": {"w": torch.ones(3)}, "optimizer_states": [], "epoch": 0}
    mine = tmp_path / "epoch=0-step=4.ckpt"
    mine.write_text("my notes")
    with pytest.raises(FileExistsError, match="'.*step=4.ckpt' exists and is not a checkpoint lit3d wrote"):
        strategy.save_checkpoint(dict(checkpoint), mine)
    assert mine.read_text() == "my notes"
    theirs = tmp_path / "last.ckpt"  # a Lightning checkpoint file (any strategy's): replaced
    torch.save({"state_dict": {"w": torch.zeros(3)}, "epoch": 0}, theirs)
    strategy.save_checkpoint(dict(checkpoint), theirs)
    strategy.save_checkpoint(dict(checkpoint), theirs)
    assert theirs.is_dir() == distributed
