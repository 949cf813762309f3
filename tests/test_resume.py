"""``--ckpt_path last``: the newest complete checkpoint, skipping unfinished, replaced and corrupt ones."""

import os
import time

import pytest
import torch

from lit3d.checkpoint.folder import save
from lit3d.checkpoint.resume import newest_complete_checkpoint


def test_the_newest_complete_checkpoint_is_chosen_and_a_corrupt_one_is_named_and_skipped(tmp_path):
    folder = tmp_path / "ckpts"
    for step in (2, 4, 6):
        save(folder / f"step={step}.ckpt", {"state_dict": {"w": torch.full((100,), float(step))}}, {}, True)
        time.sleep(0.01)  # distinct write times
    (folder / "step=6.ckpt").rename(folder / "step=8.ckpt.partial")  # a save that never finished
    (folder / "step=4.ckpt").rename(folder / "step=7.ckpt.old")  # the checkpoint a save replaced
    save(folder / "step=4.ckpt", {"state_dict": {"w": torch.full((100,), 4.0)}}, {}, True)
    shard = next((folder / "step=4.ckpt").glob("*.distcp"))
    with open(shard, "r+b") as file:  # the newest complete-looking one is truncated
        file.truncate(os.path.getsize(shard) // 2)
    with pytest.warns(UserWarning, match=r"skipping '.*step=4.ckpt': .* is truncated.*trying the one before"):
        assert newest_complete_checkpoint([folder]) == folder / "step=2.ckpt"


def test_without_a_checkpoint_training_starts_fresh_and_says_so(tmp_path, caplog):
    (tmp_path / "step=2.ckpt.partial").mkdir()
    with caplog.at_level("INFO"):
        assert newest_complete_checkpoint([tmp_path, tmp_path / "missing"]) is None
    assert "no checkpoint in" in caplog.text and "starting fresh" in caplog.text


def test_checkpoints_that_are_all_broken_are_refused_by_name_rather_than_a_fresh_start(tmp_path):
    save(tmp_path / "step=2.ckpt", {"state_dict": {"w": torch.ones(100)}}, {}, True)
    (tmp_path / "step=2.ckpt" / "meta.pt").unlink()
    refused = pytest.raises(ValueError, match=r"no checkpoint in .* is complete .*step=2.ckpt")
    with pytest.warns(UserWarning, match="skipping"), refused:
        newest_complete_checkpoint([tmp_path])


def test_last_finds_the_checkpoints_of_the_loggers_earlier_versions(tmp_path):
    """A config without a fixed checkpoint folder: its first run wrote runs/tiny/version_0/checkpoints; the requeued
    run (version_1) resumes from there."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lit3d.checkpoint.resume import checkpoint_folders

    old = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints"
    save(old / "epoch=0-step=40.ckpt", {"state_dict": {"w": torch.ones(4)}}, {}, True)
    logger = CSVLogger(str(tmp_path / "runs"), name="tiny")
    trainer = L.Trainer(logger=logger, default_root_dir=tmp_path, enable_progress_bar=False)
    assert newest_complete_checkpoint(checkpoint_folders(trainer)) == old / "epoch=0-step=40.ckpt"


def test_every_shipped_config_checkpoints_into_a_fixed_folder():
    from pathlib import Path

    import yaml

    for path in sorted((Path(__file__).parents[1] / "configs").glob("*.yaml")):
        callbacks = yaml.safe_load(path.read_text())["trainer"].get("callbacks") or []
        folders = [c["init_args"]["dirpath"] for c in callbacks if c["class_path"].endswith("ModelCheckpoint")]
        assert folders == [f"runs/{path.stem}/checkpoints"], path.name


@pytest.mark.parametrize("name", ["last.ckpt", "epoch=0-step=9.ckpt"])
def test_a_single_file_checkpoint_of_another_strategy_is_a_candidate_too(tmp_path, name):
    torch.save({"state_dict": {}}, tmp_path / name)
    assert newest_complete_checkpoint([tmp_path]) == tmp_path / name
