"""A user's own LightningModule under the 3D strategy: written for Lightning's `ModelParallelStrategy`, it runs
unchanged and trains exactly as there; one whose replicas would drift apart is refused before training."""

import pytest
import torch

MP, TRAIN = {"lightning_strategy": True}, {"trainer": {"max_steps": 5}}
JOBS = {
    "mp_dp2": {"user_module": {"tensor_parallel": False}, **MP, "strategy": {"data_parallel_size": 2,
                                                                             "tensor_parallel_size": 1}},
    "3d_dp2": {"user_module": {"tensor_parallel": False}, "strategy": {}},  # the default zero_stage=1 included
    "mp_tp2": {"user_module": {}, **MP, "strategy": {"data_parallel_size": 1, "tensor_parallel_size": 2}},
    "3d_tp2": {"user_module": {}, "strategy": {"tensor_parallel_size": 2}},
    "3d_dp2_nothing_syncs": {"user_module": {"tensor_parallel": False, "data_parallel": False}, "strategy": {},
                             "expect_error": True},
    "3d_dp2_apart": {"user_module": {"tensor_parallel": False, "data_parallel": "replicate", "seed_by_rank": True},
                     "strategy": {}, "expect_error": True},
}  # fmt: skip


@pytest.fixture(scope="module")
def user_runs(tmp_path_factory) -> dict[str, dict]:
    from spawned import run_jobs

    return run_jobs(2, {name: {**TRAIN, **job} for name, job in JOBS.items()}, tmp_path_factory.mktemp("user"))


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_a_model_parallel_strategy_module_trains_as_under_model_parallel_strategy(user_runs, layout):
    lightning, lit3d = user_runs[f"mp_{layout}"]["losses"], user_runs[f"3d_{layout}"]["losses"]
    assert len(set(lightning)) == 5  # five steps on five batches, the weights changing in between
    torch.testing.assert_close(torch.tensor(lit3d), torch.tensor(lightning), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name, message", [
    ("3d_dp2_nothing_syncs", "has parameters that nothing keeps in sync over the 2 data-parallel replicas"),
    ("3d_dp2_apart", "the data-parallel replicas of ParallelisesItself start from different weights"),
])  # fmt: skip
def test_replicas_that_would_drift_apart_are_refused_before_training_on_every_rank(user_runs, name, message):
    for rank in user_runs[name]["ranks"]:
        assert rank["error"] is not None and message in rank["error"], rank["error"]
