"""``--ckpt_path last``: the newest complete checkpoint, skipping unfinished, replaced and corrupt ones."""

import os
import time

import pytest
import torch

from lit3d.strategies.checkpoint import save
from lit3d.strategies.resume import newest_complete_checkpoint


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


def test_without_a_complete_checkpoint_training_starts_fresh_and_says_so(tmp_path, caplog):
    (tmp_path / "step=2.ckpt.partial").mkdir()
    with caplog.at_level("INFO"):
        assert newest_complete_checkpoint([tmp_path, tmp_path / "missing"]) is None
    assert "no complete checkpoint" in caplog.text and "starting fresh" in caplog.text


@pytest.mark.parametrize("name", ["last.ckpt", "epoch=0-step=9.ckpt"])
def test_a_single_file_checkpoint_of_another_strategy_is_a_candidate_too(tmp_path, name):
    torch.save({"state_dict": {}}, tmp_path / name)
    assert newest_complete_checkpoint([tmp_path]) == tmp_path / name
