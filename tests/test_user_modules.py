"""A user's own LightningModule under the 3D strategy: written for Lightning's `ModelParallelStrategy`, it runs
unchanged and trains exactly as there; one whose replicas would drift apart is refused before training."""

import pytest
import torch

MP, STEPS = {"lightning_strategy": True}, 3
TRAIN = {"trainer": {"max_steps": STEPS}}
DP2, TP2 = {"data_parallel_size": 2, "tensor_parallel_size": 1}, {"data_parallel_size": 1, "tensor_parallel_size": 2}
LLAMA = {"class": "LlamaTP"}  # Lightning's tensor-parallel example in small, with its own loss_parallel()
JOBS = {
    "mp_dp2": {"user_module": {"tensor_parallel": False}, **MP, "strategy": DP2},
    "3d_dp2": {"user_module": {"tensor_parallel": False}, "strategy": DP2},  # the default zero_stage=1 included
    "mp_tp2": {"user_module": {}, **MP, "strategy": TP2},
    "3d_tp2": {"user_module": {}, "strategy": {"tensor_parallel_size": 2}},
    "mp_defaults": {"user_module": {}, **MP, "strategy": {}},  # no sizes: TP over the node's devices
    "3d_defaults": {"user_module": {}, "strategy": {}, "leftovers": True, "watch_launcher": True},
    "3d_defaults_again": {"user_module": {}, "strategy": {}, "leftovers": True, "watch_launcher": True,
                          "same_ranks": True},  # (a second fit in the same processes)
    "mp_llama_dp2": {"user_module": LLAMA, **MP, "strategy": DP2},
    "3d_llama_dp2": {"user_module": LLAMA, "strategy": DP2},
    "mp_llama_tp2": {"user_module": LLAMA, **MP, "strategy": TP2},
    "3d_llama_tp2": {"user_module": LLAMA, "strategy": TP2},
    "3d_single_file": {"user_module": {}, "strategy": {"save_distributed_checkpoint": False}, "checkpoint_every": STEPS,
                       "whole_param_sum": True},
    **{
        f"{kind}_dp2_gain_{gain}": {"user_module": {"tensor_parallel": False, "gain": gain}, "strategy": DP2,
                                    **({"lightning_strategy": True} if kind == "mp" else {})}
        for kind in ("mp", "3d") for gain in ("frozen", "averaged")
    },
    "3d_dp2_gain_hooked": {"user_module": {"tensor_parallel": False, "gain": "hooked"}, "strategy": DP2,
                           "expect_error": True},
    "3d_dp2_nothing_syncs": {"user_module": {"tensor_parallel": False, "data_parallel": False}, "strategy": DP2,
                             "expect_error": True},
    "3d_dp2_apart": {"user_module": {"tensor_parallel": False, "data_parallel": "replicate", "seed_by_rank": True},
                     "strategy": DP2, "expect_error": True},
}  # fmt: skip
JOBS_4 = {  # 4 ranks: DP2 x TP2 on one node, and the defaults on 2 nodes x 2 devices
    "mp_llama_dp2tp2": {"user_module": LLAMA, **MP, "strategy": {"data_parallel_size": 2, "tensor_parallel_size": 2}},
    "3d_llama_dp2tp2": {"user_module": LLAMA, "strategy": {"data_parallel_size": 2, "tensor_parallel_size": 2}},
    "mp_defaults_2x2": {"user_module": {}, **MP, "strategy": {}, "nodes": 2},
    "3d_defaults_2x2": {"user_module": {}, "strategy": {}, "nodes": 2},
}  # fmt: skip


@pytest.fixture(scope="module")
def user_runs(tmp_path_factory) -> dict[str, dict]:
    from spawned import run_jobs

    return run_jobs(2, {name: {**TRAIN, **job} for name, job in JOBS.items()}, tmp_path_factory.mktemp("user"))


@pytest.fixture(scope="module")
def user_runs_4(tmp_path_factory) -> dict[str, dict]:
    from spawned import run_jobs

    return run_jobs(4, {name: {**TRAIN, **job} for name, job in JOBS_4.items()}, tmp_path_factory.mktemp("user4"))


def runs(user_runs, user_runs_4, name: str) -> dict:
    return user_runs_4[name] if name in JOBS_4 else user_runs[name]


LAYOUTS = ["dp2", "tp2", "defaults", "llama_dp2", "llama_tp2", "llama_dp2tp2", "defaults_2x2"]


@pytest.mark.parametrize("layout", [*LAYOUTS, "dp2_gain_frozen", "dp2_gain_averaged"])
def test_a_model_parallel_strategy_module_trains_as_under_model_parallel_strategy(user_runs, user_runs_4, layout):
    lightning, lit3d = (runs(user_runs, user_runs_4, f"{kind}_{layout}")["losses"] for kind in ("mp", "3d"))
    assert len(set(lightning)) == STEPS  # a step on each batch, the weights changing in between
    torch.testing.assert_close(torch.tensor(lit3d), torch.tensor(lightning), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name, message", [
    ("3d_dp2_nothing_syncs", "has parameters that nothing keeps in sync over the 2 data-parallel replicas"),
    ("3d_dp2_apart", "the data-parallel replicas of ParallelisesItself start from different weights"),
    ("3d_dp2_gain_hooked", "the data-parallel replicas of ['gain'] differ after optimizer step 2"),
])  # fmt: skip
def test_replicas_that_would_drift_apart_are_refused_before_training_on_every_rank(user_runs, name, message):
    for rank in user_runs[name]["ranks"]:
        assert rank["error"] is not None and message in rank["error"], rank["error"]


@pytest.mark.parametrize("layout", ["defaults", "defaults_2x2"])
def test_no_sizes_give_model_parallel_strategys_own_mesh(user_runs, user_runs_4, layout):
    lightning, lit3d = (runs(user_runs, user_runs_4, f"{kind}_{layout}") for kind in ("mp", "3d"))
    for rank_lightning, rank_lit3d in zip(lightning["ranks"], lit3d["ranks"], strict=True):
        assert rank_lit3d["mesh"] == rank_lightning["mesh"] and rank_lit3d["mesh"]["names"] == [
            "data_parallel",
            "tensor_parallel",
        ]
    # 1 node x 2: TP over the node; 2 nodes x 2: TP inside each node, DP across them
    assert lit3d["mesh"]["ranks"] == ([[0, 1]] if layout == "defaults" else [[0, 1], [2, 3]])


def test_two_fits_in_one_process_leave_no_thread_or_variable_behind(user_runs):
    for name in ("3d_defaults", "3d_defaults_again"):
        for rank in user_runs[name]["ranks"]:
            assert rank["leftovers"] == {"threads": [], "env": []}, (name, rank["leftovers"])
    torch.testing.assert_close(  # and the second fit is a run of its own, from the same start
        torch.tensor(user_runs["3d_defaults_again"]["losses"]), torch.tensor(user_runs["3d_defaults"]["losses"])
    )


def test_a_single_file_checkpoint_loads_in_a_plain_lightning_module_on_one_device(user_runs):
    from pathlib import Path

    from user_modules import ParallelisesItself

    folder = Path(user_runs["3d_single_file"]["job_dir"]) / "ckpts"
    (file,) = folder.iterdir()
    assert file.is_file() and file.name == f"step={STEPS}.ckpt", list(folder.iterdir())  # no shards left beside it
    model = ParallelisesItself.load_from_checkpoint(file, tensor_parallel=False, data_parallel=False)
    param_sum = sum(float(p.detach().double().sum()) for p in model.parameters())
    assert param_sum == pytest.approx(user_runs["3d_single_file"]["whole_param_sum"], rel=1e-6)
    # The whole state, as one process holds it: a plain Lightning run resumes it, AdamW's states included.
    optimizer = torch.load(file)["optimizer_states"][0]
    assert optimizer["param_groups"][0]["params"] == [0, 1, 2, 3] and sorted(optimizer["state"]) == [0, 1, 2, 3]
    import lightning as L
    from user_modules import RegressionData

    plain = ParallelisesItself(tensor_parallel=False, data_parallel=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(plain, RegressionData(), ckpt_path=file)
    assert trainer.global_step == 6


@pytest.fixture
def own_process_group():
    """This test's process group and environment (Lightning sets MASTER_PORT), ended and restored after it."""
    import os

    import torch.distributed as dist

    assert not dist.is_initialized()
    environment = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)


def test_two_fits_in_this_process_leave_nothing_behind_but_the_process_group(tmp_path, own_process_group):
    """As under Lightning, the process group stays for the next stage or fit (its store keeps its port)."""
    import os
    import threading

    import lightning as L
    import torch.distributed as dist
    from user_modules import ParallelisesItself, RegressionData

    from lit3d.strategies import Parallel3DStrategy

    losses = []
    for run in range(2):
        L.seed_everything(0)
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Parallel3DStrategy(), max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path)  # fmt: skip
        trainer.fit(ParallelisesItself(), RegressionData())
        losses.append(float(trainer.callback_metrics["train_loss"]))
        assert dist.is_initialized() and dist.get_world_size() == 1, run
        assert not [k for k in os.environ if k.startswith("LIT3D")], run
        assert not [t.name for t in threading.enumerate() if t.name.startswith("lit3d")], run
    assert losses[0] == losses[1]  # two runs alike


def test_the_final_model_saves_after_fit_returns_in_either_mode(tmp_path, own_process_group):
    """A script's last lines (Lightning's `test_strategy_state_dict` and
    `test_model_parallel_single_file_checkpoint_with_compile` on one device): once ``fit`` has returned,
    ``lightning_module_state_dict()`` has the module's names and ``trainer.save_checkpoint`` writes the trained
    weights, as one file or as a folder."""
    import lightning as L
    from user_modules import ParallelisesItself, RegressionData

    from lit3d.checkpoint.folder import read_weights
    from lit3d.strategies import Parallel3DStrategy

    for distributed in (False, True):
        model, strategy = ParallelisesItself(), Parallel3DStrategy(save_distributed_checkpoint=distributed)
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path)  # fmt: skip
        trainer.fit(model, RegressionData())
        trained = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}  # DTensors (meshes of 1)
        assert list(trainer.strategy.lightning_module_state_dict()) == list(trained), distributed
        path = tmp_path / f"final-{'folder' if distributed else 'file'}.ckpt"
        trainer.save_checkpoint(path)
        saved = read_weights(path) if distributed else torch.load(path)
        assert path.is_dir() == distributed and saved["global_step"] == 2
        torch.testing.assert_close(saved["state_dict"], trained, rtol=0, atol=0)


def test_sizes_that_do_not_fit_the_ranks_are_a_runtime_error_as_under_lightning(tmp_path, own_process_group):
    """ModelParallelStrategy raises a RuntimeError for mesh sizes (in its ranks); lit3d refuses before any rank starts,
    with an error that is a RuntimeError too (and a ValueError)."""
    import lightning as L
    from user_modules import ParallelisesItself, RegressionData

    from lit3d.strategies import Parallel3DStrategy

    strategy = Parallel3DStrategy(data_parallel_size=3, tensor_parallel_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"data_parallel_size=3 x tensor_parallel_size=1 .* = 3, but 2 ranks"):
        trainer.fit(ParallelisesItself(), RegressionData())
    with pytest.raises(ValueError):
        trainer.fit(ParallelisesItself(), RegressionData())


def test_no_fsdp2_unit_returns_a_view_that_an_in_place_op_could_break(tmp_path, text_folder, own_process_group):
    """FSDP2 warns when a unit returns a view: an in-place op on it (``out += y``) would drop the unit's pre-backward
    hook. lit3d's own units (a GPT's blocks and root under ZeRO-3) return none, nor does this suite's module that
    parallelises itself (its row-parallel layer's output stays a DTensor inside the unit: `user_modules`)."""
    import warnings

    import lightning as L
    from user_modules import ParallelisesItself, RegressionData

    from lit3d import GPT, GPTConfig
    from lit3d.data import TextDataModule
    from lit3d.strategies import Parallel3DStrategy

    def views(module: L.LightningModule, data: L.LightningDataModule, **strategy) -> list[str]:
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Parallel3DStrategy(**strategy), max_steps=2,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, data)
        return [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]

    assert views(ParallelisesItself(), RegressionData()) == []  # TP and FSDP2 over meshes of one
    config = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=256, max_seq_len=16)
    data = TextDataModule(data_path=str(text_folder), seq_len=16, global_batch_size=2)
    assert views(GPT(config), data, zero_stage=3, offload=True) == []  # FSDP2 units on one process
