"""The plan a run checks itself against is the plan of the batches it is fed (`lit3d.strategies.telemetry.plan_check`):
a lit3d data module's, a plain ``DataLoader``'s given to ``fit``, a user's own ``LightningDataModule``'s. Each run's
batches (8 x 32 tokens) are far from what a guess would plan (one sequence of the model's 128), and each logs a peak
within the band the suite holds a data-parallel layout to; `3d_auto` fed a DataLoader is refused in one line."""

import pytest
from spawned import run_jobs
from test_plan_check import DATA_PARALLEL_BAND

GPT = dict(n_layer=4, n_head=4, n_kv_head=2, d_model=64, d_ff=128, vocab_size=257, max_seq_len=128)
FED = dict(rows=64, tokens=33, batch_size=8)  # blocks of 32 inputs and their next tokens
TRAINER = {"max_steps": 5, "limit_val_batches": 0}  # (the plan check reports after the fifth step)


def _jobs(corpus) -> dict[str, dict]:
    model = {"config": GPT, "learning_rate": 1e-3}
    lit3d = dict(data_path=str(corpus), seq_len=32, global_batch_size=8, val_fraction=0.1)
    jobs = {
        "data_module": {"model": model, "data": lit3d, "strategy": {}, "trainer": TRAINER},
        "loader": {"model": model, "fed_by": "loader", "data": FED, "strategy": {}, "trainer": TRAINER},
        "user_module": {"model": model, "fed_by": "user_module", "data": FED, "strategy": {}, "trainer": TRAINER},
    }
    jobs["auto_layout_on_a_loader"] = {**jobs["loader"], "strategy": {"auto_layout": True}, "expect_error": True}
    return jobs


@pytest.fixture(scope="module")
def fed_runs(corpus, tmp_path_factory) -> dict[str, dict]:
    return run_jobs(1, _jobs(corpus), tmp_path_factory.mktemp("fed"))


@pytest.mark.parametrize("source", ["data_module", "loader", "user_module"])
def test_the_plan_check_plans_the_batches_the_run_is_fed(fed_runs, source):
    (ratio,) = fed_runs[source]["plan_check"]["peak_memory_ratio"]
    low, high = DATA_PARALLEL_BAND
    assert low <= ratio <= high, (source, ratio)


def test_every_source_is_planned_alike_from_its_first_batch(fed_runs):
    """The same model on batches of one shape: the same plan, whatever fed them (the plan check's line says which)."""
    planned = {source: fed_runs[source]["memory"]["estimate"]["total"] for source in ("loader", "user_module")}
    assert planned["loader"] == planned["user_module"] == fed_runs["data_module"]["memory"]["estimate"]["total"]


def test_3d_auto_fed_a_plain_dataloader_is_refused_naming_what_it_needs(fed_runs):
    error = fed_runs["auto_layout_on_a_loader"]["error"]
    assert error is not None and error.startswith("ConfigurationError: auto_layout=True plans for"), error
    assert "global_batch_size=None, seq_len=None" in error and "DataLoader" in error, error
