"""What a user meets in the first hour: no warning about what lit3d handles, a progress bar and usage lines that read
right. (The whole-model summary is checked on the 3D run of tests/test_cli.py.)"""

import sys
import warnings

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lit3d import GPT, GPTConfig
from lit3d.callbacks import ModelSummary, RichProgress
from lit3d.data import TextDataModule


def test_a_strategy_named_with_arguments_on_the_command_line_prints_no_args_warning(monkeypatch, tmp_path):
    """`--trainer.strategy=3d --trainer.strategy.*` is rewritten to the class path; Lightning warned that `args` and
    a command line were both given, printing the whole argv, on every such run."""
    from lit3d.cli import make_cli

    monkeypatch.chdir(tmp_path)
    argv = ["lit3d", "--trainer.logger=false", "--trainer.strategy=3d", "--trainer.strategy.zero_stage=0"]
    monkeypatch.setattr(sys, "argv", argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = make_cli(run=False)
    assert cli.trainer.strategy.parallelism.zero_stage == 0
    assert not [w for w in caught if "args parameter" in str(w.message)], [str(w.message) for w in caught]


def test_resuming_mid_epoch_does_not_warn_that_the_dataloader_is_not_resumable(text_folder, small_config, tmp_path):
    """The data module restores the exact position (tests/test_resume.py): Lightning's warning was not true."""
    quiet = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                 limit_val_batches=0, num_sanity_val_steps=0)  # fmt: skip

    def fit(max_steps, ckpt_path=None):
        saving = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
        data = TextDataModule(str(text_folder), seq_len=16, global_batch_size=4)
        L.Trainer(max_steps=max_steps, callbacks=[saving], **quiet).fit(GPT(small_config), data, ckpt_path=ckpt_path)

    fit(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(3, ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))
    assert not [w for w in caught if "not resumable" in str(w.message)]


def test_the_progress_bar_names_the_epoch_without_a_last_one_when_steps_bound_training():
    """`max_steps` alone makes the fit set `max_epochs=-1` (given here): Lightning's Rich bar read "Epoch 0/-2"."""
    by_steps, by_epochs = RichProgress(), RichProgress()
    quiet = dict(logger=False, enable_checkpointing=False, enable_model_summary=False)
    for bar, bound in ((by_steps, dict(max_steps=600, max_epochs=-1)), (by_epochs, dict(max_epochs=5))):
        bar.setup(L.Trainer(callbacks=[bar], **bound, **quiet), GPT(GPTConfig.from_name("tiny")), "fit")
    assert by_steps._get_train_description(0).strip() == "Epoch 0"
    assert by_epochs._get_train_description(3).strip() == "Epoch 3/4"


def test_the_command_line_uses_lit3d_s_progress_bar_and_model_summary(monkeypatch, tmp_path):
    from lit3d.cli import make_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # an interactive terminal
    trainer = make_cli(["--trainer.logger=false"], run=False).trainer
    assert isinstance(trainer.progress_bar_callback, RichProgress)
    assert [type(c) for c in trainer.callbacks if isinstance(c, L.pytorch.callbacks.ModelSummary)] == [ModelSummary]


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_a_command_s_usage_line_names_the_command(command, capsys):
    from lit3d.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: lit3d {command} [-c CONFIG]")
