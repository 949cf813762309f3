"""Lightning's single-file checkpoints under `Parallel3DStrategy`, both ways, and saves that never replace what lit3d
did not write (issue 46, items 1 and 8 to 12: each test checks what Lightning's test of the same subject checks for
`ModelParallelStrategy`, written here for lit3d's layouts).

- a file one process wrote (as ``ddp`` and ``auto`` do) resumes in any layout, optimizer states included, on the
  one-process curve (`test_load_standard_checkpoint_into_distributed_model`);
- ``save_distributed_checkpoint=False`` writes the whole state, optimizer states numbered as one process numbers them,
  which a plain one-process run resumes (`test_load_full_state_checkpoint_into_regular_model`);
- ``lightning_module_state_dict()`` is then the whole state on rank 0 and empty elsewhere (`test_strategy_state_dict`);
- after ``fit`` returns, a script's last ``trainer.save_checkpoint`` writes the final model in either mode (issue 63);
- ``meta.pt`` of a sharded save loads with ``torch.load``'s default (`test_save_load_sharded_state_dict`);
- a folder lit3d did not write is never replaced (`test_save_checkpoint_path_exists`), also before any setup.
"""

from pathlib import Path

import pytest
import torch
from conftest import reference
from layouts import merge, pp
from lightning.pytorch.callbacks import Callback

from lit3d.strategies import Parallel3DStrategy

STEPS, SAVED = 4, 2  # each run, and the step of the file the others resume from
FILE = f"ckpts/step={SAVED}.ckpt"


class StateDictProbe(Callback):
    """What ``lightning_module_state_dict()`` and ``optimizer_state()`` give on this rank after training."""

    def on_train_end(self, trainer, pl_module) -> None:
        state = trainer.strategy.lightning_module_state_dict()
        optimizer = trainer.strategy.optimizer_state(trainer.optimizers[0])
        self.keys, self.optimizer_keys = list(state), list(optimizer)

    def results(self) -> dict:
        return {"state_keys": self.keys, "optimizer_keys": self.optimizer_keys}


@pytest.fixture(scope="module")
def files(base_job, tmp_path_factory) -> dict:
    """One process saves a file after step `SAVED` (as ``ddp`` would); 3D layouts resume from it and write files of
    their own, which one process resumes in turn."""
    from spawned import run_jobs

    base = merge(base_job, {"trainer": {"limit_val_batches": 0, "max_steps": STEPS}})
    out = tmp_path_factory.mktemp("single_file")
    one = reference(base, {"checkpoint_every": SAVED}, out / "one_process")
    single, one_file = {"save_distributed_checkpoint": False}, str(out / "one_process" / FILE)
    jobs = {
        "from_file_dp2_pp2": merge(base, {"strategy": pp(2), "ckpt_path": one_file, "checkpoint_every": SAVED}),
        "from_file_dp2_tp2_zero3": merge(
            base,
            {
                "strategy": {"tensor_parallel_size": 2, "zero_stage": 3},
                "ckpt_path": one_file,
                "checkpoint_every": SAVED,
                "save_after_fit": True,
            },
        ),
        "file_dp2_pp2": merge(
            base, {"strategy": pp(2, **single), "checkpoint_every": SAVED, "callbacks": [StateDictProbe()]}
        ),
        "file_dp2_tp2_zero1": merge(
            base,
            {
                "strategy": {"tensor_parallel_size": 2, "zero_stage": 1, **single},
                "checkpoint_every": SAVED,
                "save_after_fit": True,
            },
        ),
    }
    results = run_jobs(4, jobs, out)
    resumed = {"one_process_from_pp2_file": merge(base, {"ckpt_path": f"job:file_dp2_pp2/{FILE}"})}
    results.update(run_jobs(1, resumed, out))
    return {"one_process": one, **results, "out": out}


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) > 0 and max(abs(x - y) / abs(y) for x, y in zip(a, b)) <= 1e-5


@pytest.mark.parametrize("layout", ["from_file_dp2_pp2", "from_file_dp2_tp2_zero3"])
def test_a_one_process_file_resumes_in_any_layout_on_its_curve(files, layout):
    assert close(files[layout]["losses"], files["one_process"]["losses"][SAVED:])


@pytest.mark.parametrize("layout", ["file_dp2_pp2", "file_dp2_tp2_zero1"])
def test_a_single_file_holds_the_whole_state_as_one_process_holds_it(files, layout):
    mine = torch.load(files["out"] / layout / FILE)  # torch.load's default: data only
    theirs = torch.load(files["out"] / "one_process" / FILE)
    assert list(mine["state_dict"]) == list(theirs["state_dict"])  # every key, in the module's order
    torch.testing.assert_close(
        mine["state_dict"], theirs["state_dict"], rtol=1e-5, atol=1e-5
    )  # float rounding, which AdamW scales up
    (optimizer,), (expected,) = mine["optimizer_states"], theirs["optimizer_states"]
    assert optimizer["param_groups"] == expected["param_groups"]  # numbered as one process numbers them
    assert list(optimizer["state"]) == list(expected["state"])
    torch.testing.assert_close(optimizer["state"], expected["state"], rtol=1e-4, atol=1e-7)


def test_one_process_resumes_a_layouts_file_on_the_same_curve(files):
    assert close(files["one_process_from_pp2_file"]["losses"], files["one_process"]["losses"][SAVED:])


def test_the_whole_state_dict_is_on_rank_zero_only(files):
    ranks = files["file_dp2_pp2"]["ranks"]
    theirs = torch.load(files["out"] / "one_process" / FILE)
    assert ranks[0]["state_keys"] == list(theirs["state_dict"])
    assert ranks[0]["optimizer_keys"] == ["state", "param_groups"]
    assert all(rank["state_keys"] == rank["optimizer_keys"] == [] for rank in ranks[1:])


@pytest.mark.parametrize("layout", ["file_dp2_tp2_zero1", "from_file_dp2_tp2_zero3"])
def test_the_final_model_saves_after_fit_returns_in_either_mode(files, layout):
    """DP2 x TP2, one file or a folder: once ``fit`` has returned, ``lightning_module_state_dict()`` is the whole state
    on rank 0 (one file) or every rank's shards (a folder), by the one-process names, and ``trainer.save_checkpoint``
    writes what the fit's last checkpoint (step `STEPS`) holds."""
    from lit3d.checkpoint.folder import read_weights

    folder, ranks = files["out"] / layout, files[layout]["ranks"]
    names = list(torch.load(files["out"] / "one_process" / FILE)["state_dict"])
    if layout == "file_dp2_tp2_zero1":
        assert [rank["state_keys_after_fit"] for rank in ranks] == [names, [], [], []]
        after_fit, last = torch.load(folder / "after_fit.ckpt"), torch.load(folder / "ckpts" / f"step={STEPS}.ckpt")
        torch.testing.assert_close(after_fit["optimizer_states"], last["optimizer_states"], rtol=0, atol=0)
    else:
        assert [rank["state_keys_after_fit"] for rank in ranks] == [names] * 4
        after_fit, last = read_weights(folder / "after_fit.ckpt"), read_weights(folder / "ckpts" / f"step={STEPS}.ckpt")
    assert after_fit["global_step"] == STEPS and sorted(after_fit["state_dict"]) == sorted(names)
    torch.testing.assert_close(after_fit["state_dict"], last["state_dict"], rtol=0, atol=0)


def test_a_sharded_checkpoints_meta_file_loads_with_torch_loads_default(files):
    meta = torch.load(files["out"] / "from_file_dp2_pp2" / "ckpts" / f"step={STEPS}.ckpt" / "meta.pt")
    assert meta["hyper_parameters"]["learning_rate"] == 1e-2 and meta["global_step"] == STEPS
    assert "numpy" in meta["rng"] and "state_dict" not in meta and "optimizer_states" not in meta


def test_a_folder_lit3d_did_not_write_is_never_replaced(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "notes.txt").write_text("mine")
    checkpoint = lambda: {"state_dict": {"w": torch.ones(3)}, "optimizer_states": [], "epoch": 0}
    with pytest.raises(IsADirectoryError, match="'.*results' exists and is a directory lit3d did not write"):
        Parallel3DStrategy(save_distributed_checkpoint=False).save_checkpoint(checkpoint(), results)
    with pytest.raises(FileExistsError, match="holds notes.txt"):
        Parallel3DStrategy().save_checkpoint(checkpoint(), results)
    partial = tmp_path / "saved.ckpt.partial"  # where a save writes first: not someone else's folder either
    partial.mkdir()
    (partial / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="saved.ckpt.partial"):
        Parallel3DStrategy().save_checkpoint(checkpoint(), tmp_path / "saved.ckpt")
    assert (results / "notes.txt").read_text() == (partial / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results", "saved.ckpt.partial"]  # nothing written


def test_what_lit3d_wrote_is_replaced_before_any_setup(tmp_path):
    path = tmp_path / "step.ckpt"
    sharded = Parallel3DStrategy()
    sharded.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "optimizer_states": [], "epoch": 0}, path)
    assert path.is_dir() and (path / "meta.pt").is_file()
    assert torch.load(path / "meta.pt")["epoch"] == 0  # torch.load's default reads it
    # A single file replaces that folder (its own); a folder replaces a file; an empty folder holds nothing to lose.
    Parallel3DStrategy(save_distributed_checkpoint=False).save_checkpoint({"state_dict": {"w": torch.zeros(3)}}, path)
    assert path.is_file() and torch.equal(torch.load(path)["state_dict"]["w"], torch.zeros(3))
    sharded.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "optimizer_states": [], "epoch": 1}, path)
    assert path.is_dir()
    empty = tmp_path / "empty"
    empty.mkdir()
    sharded.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "optimizer_states": []}, empty)
    assert (empty / ".metadata").is_file()


def test_loading_before_setup_names_the_checkpoint(tmp_path):
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(ValueError, match="checkpoint folder '.*empty_dir' is empty"):
        Parallel3DStrategy().load_checkpoint(empty)
    with pytest.raises(FileNotFoundError, match="'.*nope.ckpt' does not exist"):
        Parallel3DStrategy().load_checkpoint(tmp_path / "nope.ckpt")
    path = tmp_path / "step.ckpt"
    Parallel3DStrategy().save_checkpoint({"state_dict": {"w": torch.ones(3)}, "optimizer_states": []}, path)
    with pytest.raises(RuntimeError, match="needs a module that a Trainer has set up"):
        Parallel3DStrategy().load_checkpoint(path)


def test_an_old_checkpoints_remove_keeps_a_folder_lit3d_did_not_write(tmp_path):
    from lit3d.checkpoint.save_load import remove

    folder = tmp_path / "step=1.ckpt"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.warns(UserWarning, match="not removing"):
        remove(folder)
    assert (folder / "notes.txt").exists()
    assert Path(folder).exists()
