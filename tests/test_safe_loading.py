"""Trust boundaries: a checkpoint from elsewhere runs no code, through every path that opens one, and a corrupt index
fails before anything large is allocated."""

import pickle
import random
import re
import shutil
import types
from io import BytesIO
from pathlib import Path

import pytest
import torch
from layouts import STEPS

from lit3d import GPT
from lit3d.checkpoint.folder import ShardedCheckpointReader, check_ckpt_path, load, read_weights
from lit3d.checkpoint.safe_io import (
    META_FILE,
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    check_readable,
)

ROOT = Path(__file__).resolve().parents[1]


class CreatesMarker:
    """Unpickling this creates a file: the proof that a loader ran code from a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.fixture(scope="module")
def good(layout_runs) -> Path:
    return Path(layout_runs["dp2_tp2_pp2_zero1"]["job_dir"]) / "ckpts" / f"step={STEPS}.ckpt"


@pytest.fixture(params=["meta.pt", ".metadata"])
def crafted(request, good, tmp_path) -> tuple[Path, Path, str]:
    """A copy of a real DP2 x TP2 x PP2 checkpoint whose ``meta.pt`` or DCP ``.metadata`` would create a marker."""
    folder, marker = tmp_path / "crafted.ckpt", tmp_path / "MARKER"
    shutil.copytree(good, folder)
    if request.param == META_FILE:
        meta = torch.load(folder / META_FILE, weights_only=False)  # our own file, in the test: trusted
        torch.save({**meta, "hyper_parameters": {**meta["hyper_parameters"], "x": CreatesMarker(marker)}},
                   folder / META_FILE)  # fmt: skip
    else:
        metadata = SafeFileSystemReader(str(good)).read_metadata()
        metadata.planner_data = CreatesMarker(marker)
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return folder, marker, request.param


def single_file(crafted, tmp_path) -> Path:
    """The crafted meta as a single Lightning checkpoint file (what `lit3d convert` writes)."""
    folder, marker, _ = crafted
    path = tmp_path / "crafted-file.ckpt"
    torch.save({"hyper_parameters": {"config": "tiny", "x": CreatesMarker(marker)}, "state_dict": {}}, path)
    return path


OPENERS = {
    "fit --ckpt_path (Parallel3DStrategy)": lambda path: (check_readable(path), load(path, {})),
    "validate under auto (ShardedCheckpointReader)": lambda path: ShardedCheckpointReader().load_checkpoint(path),
    "GPT.load_from_checkpoint": lambda path: GPT.load_from_checkpoint(path),
    "GPT(pretrained=...)": lambda path: GPT(pretrained=str(path)).configure_model(),
    "read_weights": read_weights,
}


@pytest.mark.parametrize("opener", OPENERS)
def test_a_crafted_checkpoint_is_refused_by_every_api_without_running_its_code(crafted, opener):
    folder, marker, file = crafted
    with pytest.raises(UnsafeCheckpointError, match=re.escape(str(folder / file))):
        OPENERS[opener](folder)
    assert not marker.exists()


@pytest.mark.parametrize("command", ["export", "convert", "generate", "validate", "fit"])
def test_a_crafted_checkpoint_is_refused_by_every_command_without_running_its_code(
    crafted, command, corpus, tmp_path, monkeypatch
):
    from lit3d.cli import main

    monkeypatch.chdir(tmp_path)  # LightningCLI saves its config.yaml here

    folder, marker, file = crafted
    args = {
        "export": ["export", "--ckpt_path", str(folder), "--output", str(tmp_path / "hf")],
        "convert": ["convert", "--ckpt_path", str(folder), "--output", str(tmp_path / "one.ckpt")],
        "generate": ["generate", "--ckpt_path", str(folder), "--prompt", "x", "--max_new_tokens", "1"],
        "validate": ["validate", "--config", str(ROOT / "configs" / "tiny.yaml"), "--ckpt_path", str(folder),
                     "--trainer.logger=false", f"--data.init_args.data_path={corpus}", "--data.init_args.seq_len=16",
                     "--trainer.callbacks=[]"],
        "fit": ["fit", "--model.pretrained", str(folder), "--trainer.logger=false"],
    }[command]  # fmt: skip
    with pytest.raises((UnsafeCheckpointError, SystemExit), match=re.escape(str(folder / file))):
        main(args)
    assert not marker.exists()


def test_a_crafted_single_file_is_refused(crafted, tmp_path):
    path = single_file(crafted, tmp_path)
    for opener in ("validate under auto (ShardedCheckpointReader)", "GPT.load_from_checkpoint", "GPT(pretrained=...)"):
        with pytest.raises(UnsafeCheckpointError, match=re.escape(str(path))):
            OPENERS[opener](path)
    assert not crafted[1].exists()


def test_a_crafted_non_tensor_entry_is_refused(tmp_path):
    """DCP stores non-tensor entries (optimizer hyper-parameters) as pickles; its own planner loads them unchecked."""
    marker, entry = tmp_path / "MARKER", BytesIO()
    torch.save(CreatesMarker(marker), entry)
    entry.seek(0)
    planner = SafeLoadPlanner()
    planner.flatten_state_dict, planner.state_dict = False, {}
    item = types.SimpleNamespace(dest_index=types.SimpleNamespace(fqn="optimizer_states.0.param_groups"))
    with pytest.raises(UnsafeCheckpointError, match="optimizer_states.0.param_groups"):
        planner.load_bytes(item, entry)
    assert not marker.exists()


def test_an_index_claiming_absurd_sizes_is_refused_before_allocating(good, tmp_path):
    folder = tmp_path / "absurd.ckpt"
    shutil.copytree(good, folder)
    metadata = SafeFileSystemReader(str(good)).read_metadata()
    entry = metadata.state_dict_metadata["state_dict.model.blocks.1.mlp.up_proj.weight"]
    entry.size = torch.Size([10**9, 10**9])
    entry.chunks[0].sizes = torch.Size([10**9, 10**9])
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ValueError, match=r"is corrupt: 'state_dict.model.blocks.1.mlp.up_proj.weight' claims"):
        read_weights(folder)


def test_every_checkpoint_reader_goes_through_the_safe_ones():
    """The loading calls that can run code appear only in `lit3d.checkpoint.safe_io`, or pass its readers."""
    sources = sorted((ROOT / "lit3d").rglob("*.py")) + sorted((ROOT / "strategies").rglob("*.py"))
    unsafe = {
        r"\btorch\.load\(": "torch.load outside safe_io.load_meta",
        r"\bpickle\.(load|loads|Unpickler)\b": "pickle outside safe_io",
        r"(?<!Safe)FileSystemReader\(": "DCP's FileSystemReader (use SafeFileSystemReader)",
        r"weights_only\s*=\s*False": "weights_only=False",
        r"trust_remote_code\s*=\s*True": "trust_remote_code=True",
    }
    found = []
    for source in sources:
        if source.name == "safe_io.py":
            continue
        for number, line in enumerate(source.read_text().splitlines(), 1):
            found += [f"{source.relative_to(ROOT)}:{number}: {why}" for pattern, why in unsafe.items()
                      if re.search(pattern, line)]  # fmt: skip
            if re.search(r"\bdcp\.load\(|_load_state_dict\(", line) and "SafeFileSystemReader" not in line:
                found.append(f"{source.relative_to(ROOT)}:{number}: a DCP load without SafeFileSystemReader")
    assert not found, "\n".join(found)
    assert len(sources) > 30  # the scan sees the whole library


@pytest.fixture
def tiny_folder(tmp_path) -> Path:
    """A one-process lit3d checkpoint folder of two numbers (``.metadata``, one shard, ``meta.pt``)."""
    from lit3d.checkpoint.folder import save

    folder = tmp_path / "tiny.ckpt"
    with pytest.warns(UserWarning, match="single process"):
        save(folder, {"state_dict": {"model.x": torch.zeros(2)}}, {"hyper_parameters": {"config": "tiny"}}, True)
    return folder


BROKEN = {
    "empty": lambda good: b"",
    "truncated": lambda good: good[: len(good) // 2],
    "garbage": lambda good: random.Random(0).randbytes(200),
    "text": lambda good: b"not a checkpoint\n",
}


@pytest.mark.parametrize("kind", BROKEN)
def test_a_corrupt_meta_file_is_called_corrupt_not_a_security_refusal(tiny_folder, kind, tmp_path):
    """A broken ``meta.pt`` was refused as if it held code, with advice to load it with ``weights_only=False``."""
    from lit3d.checkpoint.safe_io import CorruptCheckpointError, load_meta
    from lit3d.cli import main

    meta = tiny_folder / META_FILE
    meta.write_bytes(BROKEN[kind](meta.read_bytes()))
    with pytest.raises(CorruptCheckpointError) as error:
        load_meta(meta)
    message = str(error.value)
    assert str(meta) in message and ("corrupt" in message or "empty" in message), message
    assert "weights_only" not in message and "code" not in message and "\n" not in message, message
    with pytest.raises(SystemExit) as ended:
        main(["convert", "--ckpt_path", str(tiny_folder), "--output", str(tmp_path / "one.ckpt")])
    assert str(ended.value.code) == f"lit3d convert: error: {message}"
    with pytest.raises(CorruptCheckpointError):  # `fit/validate --ckpt_path`: before any rank starts
        check_ckpt_path(tiny_folder)


def test_a_meta_file_that_holds_code_is_still_refused_as_unsafe(tmp_path):
    from lit3d.checkpoint.safe_io import load_meta

    marker, path = tmp_path / "MARKER", tmp_path / "meta.pt"
    torch.save({"hyper_parameters": {"x": CreatesMarker(marker)}}, path)
    with pytest.raises(UnsafeCheckpointError, match="holds more than data"):
        load_meta(path)
    assert not marker.exists()


def test_a_corrupt_dcp_index_is_called_corrupt(tiny_folder):
    from lit3d.checkpoint.safe_io import CorruptCheckpointError

    index = tiny_folder / ".metadata"
    index.write_bytes(index.read_bytes()[:40])
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{str(index)!r} is corrupt or truncated")):
        check_readable(tiny_folder)


@pytest.mark.parametrize("command", ["convert", "export", "validate"])
def test_an_empty_checkpoint_folder_is_empty_not_missing(command, tmp_path, monkeypatch):
    from lit3d.cli import main

    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "step=8.ckpt"
    empty.mkdir()
    with pytest.raises(ValueError, match=re.escape(f"checkpoint folder {str(empty)!r} is empty")):
        check_readable(empty)
    args = {
        "convert": ["convert", "--ckpt_path", str(empty), "--output", str(tmp_path / "one.ckpt")],
        "export": ["export", "--ckpt_path", str(empty), "--output", str(tmp_path / "hf")],
        "validate": ["validate", "--ckpt_path", str(empty), "--trainer.logger=false"],
    }[command]
    with pytest.raises(SystemExit) as ended:
        main(args)
    assert str(ended.value.code) == f"lit3d {command}: error: checkpoint folder {str(empty)!r} is empty", ended.value
