"""A preempted run resumed with ``ckpt_path="last"`` continues the uninterrupted loss curve exactly, whatever the
`ModelCheckpoint` settings, whether Lightning (``Trainer.fit(ckpt_path="last")``) or lit3d (``--ckpt_path last``,
`newest_complete_checkpoint`) resolves "last", with single-file checkpoints (one process) and folders (2 ranks)."""

import json
import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import logged
from layouts import merge
from lightning.pytorch.callbacks import ModelCheckpoint
from spawned import START_METHOD, free_port, run_job

from lit3d.checkpoint.resume import newest_complete_checkpoint
from lit3d.strategies.runtime.preemption import StopOnSignal

SIGNALLED_IN = 2  # the step (0-based) during which SIGTERM arrives; one process stops after it, at global step 3
STOPPED_AT = SIGNALLED_IN + 1
MAX_STEPS = STOPPED_AT + 2  # the same in every run: the learning-rate schedule follows it
ONE_PROCESS = {"trainer": {"max_steps": MAX_STEPS, "limit_val_batches": 0, "enable_checkpointing": True}}


class SignalAt(L.Callback):
    """SIGTERM to this process at the start of step ``step`` on rank ``rank``, as a scheduler sends it."""

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


class ResumedFrom(L.Callback):
    """Records the checkpoint the fit resumed from (after Lightning resolved ``"last"``)."""

    def __init__(self) -> None:
        self.path = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.path = trainer.ckpt_path and str(Path(trainer.ckpt_path).resolve())

    def results(self) -> dict:
        return {"resumed_from": self.path}


@pytest.fixture(scope="module")
def uninterrupted(base_job, tmp_path_factory) -> list[float]:
    job = merge(base_job, merge(ONE_PROCESS, {"trainer": {"enable_checkpointing": False}}))
    return run_job(job, tmp_path_factory.mktemp("uninterrupted"))["losses"]


SETTINGS = {
    "save_last_by_steps": dict(save_last=True, every_n_train_steps=2, save_top_k=1),
    "no_last_by_steps_all": dict(save_last=False, every_n_train_steps=2, save_top_k=-1),
    "link_last_by_steps": dict(save_last="link", every_n_train_steps=2, save_top_k=1),
    "save_last_by_epochs_all": dict(save_last=True, every_n_epochs=1, save_top_k=-1),
    "no_last_by_epochs": dict(save_last=None, every_n_epochs=1, save_top_k=1),
    "link_last_by_epochs_none_kept": dict(save_last="link", every_n_epochs=1, save_top_k=0),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_preempted_run_resumes_its_curve_with_any_model_checkpoint_and_either_last(
    setting, base_job, uninterrupted, tmp_path
):
    """One process, single-file checkpoints: SIGTERM in step 2, the run saves, exits 143 and restores the signal
    handlers; its metrics.csv holds every step it ran, the last too; lit3d's "last" and Lightning's are the preemption
    checkpoint, and resuming continues the curve."""
    ckpts = tmp_path / "ckpts"
    job = merge(base_job, ONE_PROCESS)
    handler = signal.getsignal(signal.SIGTERM)
    stopping = [ModelCheckpoint(dirpath=ckpts, **SETTINGS[setting]), StopOnSignal(), SignalAt(SIGNALLED_IN)]
    with pytest.raises(SystemExit) as stopped:
        run_job({**job, "callbacks": stopping}, tmp_path / "preempted")
    assert stopped.value.code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) is handler
    assert logged(tmp_path / "preempted" / "log" / "version_0", "train_loss") == uninterrupted[:STOPPED_AT]
    preempted = (ckpts / f"preempted-step={STOPPED_AT}.ckpt").resolve()
    assert newest_complete_checkpoint([ckpts]).resolve() == preempted  # lit3d's "last"

    callbacks = [ModelCheckpoint(dirpath=ckpts, **SETTINGS[setting]), ResumedFrom()]
    resumed = run_job({**job, "callbacks": callbacks, "ckpt_path": "last"}, tmp_path / "resumed")
    assert resumed["resumed_from"] == str(preempted)  # Lightning's "last"
    assert resumed["losses"] == uninterrupted[STOPPED_AT:]  # exactly


@pytest.mark.ranks
def test_two_ranks_preempted_with_save_last_resume_their_curve_from_the_checkpoint_folder(base_job, tmp_path):
    """DP2 under `Parallel3DStrategy` (checkpoint folders), ``ModelCheckpoint(save_last=True,
    every_n_train_steps=1000)``: rank 1 is sent SIGTERM, both ranks stop after an agreed step, exit 143 with every
    step they ran in metrics.csv (the last too), and Lightning's "last" (and lit3d's) resume from the preemption
    checkpoint, continuing the uninterrupted curve."""
    job = merge(base_job, {"strategy": {}, "trainer": {"max_steps": 7, "enable_checkpointing": True}})
    mp.start_processes(_preempt_resume_and_run_uninterrupted, args=(2, free_port(), job, str(tmp_path)), nprocs=2,
                       start_method=START_METHOD)  # fmt: skip
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [rank["exit_code"] for rank in ranks] == [128 + signal.SIGTERM] * 2
    run = ranks[0]
    preempted = str((tmp_path / "ckpts" / f"preempted-step={run['step']}.ckpt").resolve())
    assert run["lit3d_last"] == run["resumed_from"] == preempted
    assert logged(tmp_path / "a" / "log" / "version_0", "train_loss") == run["uninterrupted"][: run["step"]]
    assert len(run["resumed"]) == 7 - run["step"] and run["resumed"] == run["uninterrupted"][run["step"] :]


def _preempt_resume_and_run_uninterrupted(rank: int, world: int, port: int, job: dict, out: str) -> None:
    """One spawned rank: the preempted run, its resume with ``ckpt_path="last"``, and the uninterrupted run."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0")  # fmt: skip
    torch.set_num_threads(1)
    out, result = Path(out), {"exit_code": None}
    saving = {"dirpath": out / "ckpts", "save_last": True, "every_n_train_steps": 1000}
    try:
        run_job({**job, "callbacks": [ModelCheckpoint(**saving), SignalAt(SIGNALLED_IN, rank=1)]}, out / "a", world)
    except SystemExit as stop:
        result["exit_code"] = stop.code
    (preempted,) = (out / "ckpts").glob("preempted-step=*.ckpt")
    result["step"] = int(preempted.name.removeprefix("preempted-step=").removesuffix(".ckpt"))
    result["lit3d_last"] = str(newest_complete_checkpoint([out / "ckpts"]).resolve())
    resumed = run_job({**job, "callbacks": [ModelCheckpoint(**saving), ResumedFrom()], "ckpt_path": "last"},
                      out / "b", world)  # fmt: skip
    result.update(resumed_from=resumed["resumed_from"], resumed=resumed.get("losses"))  # losses: rank 0's log
    uninterrupted = run_job(merge(job, {"trainer": {"enable_checkpointing": False}}), out / "c", world)
    result["uninterrupted"] = uninterrupted.get("losses")
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
