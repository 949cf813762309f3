"""A run resumed with a larger ``max_steps`` follows the learning-rate schedule of its new horizon, and says so."""

import logging

import lightning as L
import pytest
from layouts import merge
from spawned import run_job

from lit3d.models.gpt import WarmupCosine

PEAK, WARMUP, FLOOR = 1e-2, 2, 0.1  # `base_job`'s learning_rate and warmup_steps, GPT's default min_lr_ratio


class RecordLR(L.Callback):
    """The learning rate of every parameter group in each optimizer step, by global step."""

    def __init__(self) -> None:
        self.lrs: dict[int, list[float]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lrs[trainer.global_step] = [group["lr"] for group in trainer.optimizers[0].param_groups]

    def results(self) -> dict:
        return {"lrs": self.lrs}


@pytest.fixture(scope="module")
def saved_at_20(base_job, tmp_path_factory):
    """A 20-step run (its schedule decays to the floor at step 20), checkpointed at its end."""
    folder = tmp_path_factory.mktemp("twenty_steps")
    job = merge(base_job, {"trainer": {"max_steps": 20, "limit_val_batches": 0, "enable_checkpointing": True}})
    run_job({**job, "checkpoint_every": 20}, folder)
    return folder / "ckpts" / "step=20.ckpt"


@pytest.mark.parametrize(
    ("decay_steps", "max_steps"), [(None, 40), (20, 25)], ids=["horizon_max_steps", "horizon_kept_by_decay_steps"]
)
def test_a_run_resumed_with_a_larger_max_steps_follows_the_schedule_of_its_horizon(
    decay_steps, max_steps, base_job, saved_at_20, tmp_path, caplog
):
    """Resumed at step 20 with ``max_steps=40``: the learning rate of steps 20..39 is ``learning_rate x
    WarmupCosine(warmup_steps, 40, min_lr_ratio)(step)``, as in a run planned for 40 steps, and the log says the
    schedule was stretched; with ``decay_steps=20`` (to step 25) the old one is kept (the floor), nothing said."""
    trainer = {"max_steps": max_steps, "limit_val_batches": 0}
    job = merge(base_job, {"model": {"decay_steps": decay_steps}, "trainer": trainer})
    with caplog.at_level(logging.INFO):
        resumed = run_job({**job, "callbacks": [RecordLR()], "ckpt_path": str(saved_at_20)}, tmp_path)
    horizon = max_steps if decay_steps is None else decay_steps
    assert list(resumed["lrs"]) == list(range(20, max_steps))
    expected = [PEAK * WarmupCosine(WARMUP, horizon, FLOOR)(s) for s in range(20, max_steps) for _group in range(2)]
    assert [lr for lrs in resumed["lrs"].values() for lr in lrs] == pytest.approx(expected, rel=1e-12)
    said = [r.getMessage() for r in caplog.records if "learning-rate schedule" in r.getMessage()]
    if decay_steps is None:
        assert all(lr > PEAK * FLOOR for lr, _ in list(resumed["lrs"].values())[:-1])  # not at the floor
        assert len(said) == 1 and "stretched from 20 to 40 steps" in said[0], said
    else:
        assert all(lr == pytest.approx(PEAK * FLOOR) for lr, _ in resumed["lrs"].values()) and said == []
