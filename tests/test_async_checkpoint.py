"""Sharded saves written in the background: they resume like synchronous ones, a failed write is raised naming
its folder, and a process killed mid-write leaves the previous checkpoint as it was."""

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import forked
import pytest
import torch
from layouts import HALF, STEPS, merge

from lit3d.checkpoint.background import BackgroundSaves
from lit3d.checkpoint.folder import PARTIAL_SUFFIX, read_weights
from lit3d.checkpoint.safe_io import check_readable


@pytest.fixture(scope="module")
def async_saved(base_job, tmp_path_factory) -> dict:
    """DP2 ZeRO-1 saving in the background every `HALF` steps, resumed from step `HALF` at TP2 (also in
    the background)."""
    from spawned import run_jobs

    out = tmp_path_factory.mktemp("async_checkpoints")
    base = merge(base_job, {"trainer": {"limit_val_batches": 0}})
    saved = str(out / "dp2" / "ckpts" / f"step={HALF}.ckpt")
    job = {"strategy": {"async_checkpoint": True}, "checkpoint_every": HALF}
    results = run_jobs(2, {"dp2": merge(base, job)}, out)
    resumed = {"strategy": {"async_checkpoint": True, "tensor_parallel_size": 2}, "ckpt_path": saved}
    results.update(run_jobs(2, {"resume_tp2": merge(base, resumed)}, out))
    return {**results, "folder": out / "dp2" / "ckpts"}


def test_background_saves_are_complete_at_the_end_and_resume_in_another_layout(async_saved):
    folder = async_saved["folder"]
    names = [f"step={step}.ckpt" for step in range(HALF, STEPS + 1, HALF)]  # (every step when HALF is 1)
    assert sorted(p.name for p in folder.iterdir()) == names  # no .partial left
    for name in names:
        check_readable(folder / name)  # the end of training waited for the last one
    uninterrupted, resumed = async_saved["dp2"]["losses"], async_saved["resume_tp2"]["losses"]
    assert len(uninterrupted) == STEPS and len(resumed) == STEPS - HALF
    assert max(abs(a - b) for a, b in zip(resumed, uninterrupted[HALF:])) <= 1e-5


def test_a_failed_background_write_is_raised_at_the_next_save_naming_the_folder(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the checkpoint's parent folder should be")
    saves, tensors = BackgroundSaves(), {"state_dict": {"w": torch.ones(3)}}
    saves.start(blocker / "step=1.ckpt", tensors, {}, True)  # returns: the write fails in the background
    with pytest.raises(RuntimeError, match=r"background save of checkpoint '.*step=1.ckpt' failed on rank\(s\) \[0\]"):
        saves.start(tmp_path / "step=2.ckpt", tensors, {}, True)
    saves.start(tmp_path / "step=3.ckpt", tensors, {"step": 3}, True)  # the failure was reported once
    saves.wait()
    assert read_weights(tmp_path / "step=3.ckpt")["step"] == 3


SLOW_SECOND_SAVE = """
import sys, time
from pathlib import Path
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from lit3d.checkpoint.background import BackgroundSaves

folder, saves = Path(sys.argv[1]), BackgroundSaves()
saves.start(folder / "step=1.ckpt", {"state_dict": {"w": torch.full((1000,), 1.0)}}, {"step": 1}, True)
saves.wait()
write = FileSystemWriter.write_data
def slow(self, *args, **kwargs):
    print("writing", flush=True)  # in the background thread, inside the write of step=2.ckpt's shards
    time.sleep(60)
    return write(self, *args, **kwargs)
FileSystemWriter.write_data = slow
saves.start(folder / "step=2.ckpt", {"state_dict": {"w": torch.full((1000,), 2.0)}}, {"step": 2}, True)
time.sleep(60)
"""


def test_a_process_killed_during_a_background_write_leaves_the_previous_checkpoint(tmp_path):
    process = forked.start([sys.executable, "-c", textwrap.dedent(SLOW_SECOND_SAVE), str(tmp_path)],
                           cwd=Path(__file__).parent, env=dict(os.environ))  # fmt: skip
    try:
        deadline = time.time() + 120
        while not process.stdout():
            assert process.poll() is None and time.time() < deadline, process.stderr()[-3000:]
            time.sleep(0.1)
        assert process.stdout().strip() == "writing"
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        process.kill()
    assert read_weights(tmp_path / "step=1.ckpt")["state_dict"]["w"].eq(1.0).all()
    assert not (tmp_path / "step=2.ckpt").exists() and (tmp_path / f"step=2.ckpt{PARTIAL_SUFFIX}").exists()
    with pytest.raises(FileNotFoundError, match="step=2.ckpt"):
        check_readable(tmp_path / "step=2.ckpt")
