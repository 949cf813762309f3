"""lit3d's command line: ``lit3d fit|validate|test|predict --config ...`` (LightningCLI), and ``lit3d plan``,
``export``, ``convert``, ``generate`` (`lit3d.commands`).

Installed as the ``lit3d`` console script; ``python cli.py ...`` from a checkout does the same.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import (
    BasePredictionWriter,
    Callback,
    LearningRateMonitor,
    ProgressBar,
    RichProgressBar,
)
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

import lit3d.strategies  # registers "3d" and makes `Parallel3DStrategy` resolvable by its short name
from lit3d.callbacks import PrintCompletions, Throughput
from lit3d.gpt import GPT, check_model_fits_data
from lit3d.strategies.checkpoint import ShardedCheckpointReader, check_ckpt_path
from lit3d.strategies.resume import newest_complete_checkpoint
from lit3d.strategies.safe_io import UnsafeCheckpointError


class Lit3DCLI(LightningCLI):
    """LightningCLI with lit3d's defaults: the tiny GPT on the embedded corpus, a Rich progress bar when
    interactive, the `Throughput` callback (tokens/s, MFU) unless the config has one, `PrintCompletions` for
    ``predict``, and a checkpoint reader that also takes lit3d's sharded folders under any strategy."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.set_defaults(
            {
                "model": {"class_path": "lit3d.GPT"},
                "data": {"class_path": "lit3d.data.TextDataModule"},
            }
        )

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        configured = config.get("callbacks") or []  # one callback or a list, as `Trainer(callbacks=...)` takes
        given = [*([configured] if isinstance(configured, Callback) else configured), *callbacks]
        if (
            sys.stdout.isatty()
            and config.get("enable_progress_bar") is not False
            and not any(isinstance(c, ProgressBar) for c in given)
        ):
            callbacks = [*callbacks, RichProgressBar()]
        if not any(isinstance(c, Throughput) for c in given):  # tokens/s and MFU for every run
            callbacks = [*callbacks, Throughput()]
        if self.subcommand == "predict" and not any(isinstance(c, BasePredictionWriter) for c in given):
            callbacks = [*callbacks, PrintCompletions()]
        if config.get("logger") is False and any(isinstance(c, LearningRateMonitor) for c in given):
            rank_zero_warn("logger=False: the LearningRateMonitor callback has nowhere to log and is left out")
            callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
            if isinstance(config.get("callbacks"), list):
                config["callbacks"] = [c for c in config["callbacks"] if not isinstance(c, LearningRateMonitor)]
            elif isinstance(config.get("callbacks"), LearningRateMonitor):
                config["callbacks"] = []
        plugins = config.get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):  # lit3d's folders load under any strategy
            config["plugins"] = [*plugins, ShardedCheckpointReader()]
        return super()._instantiate_trainer(config, callbacks)

    def instantiate_classes(self) -> None:
        """Lightning's; a class refusing its arguments (a missing file, a bad value) ends the command with that one
        message rather than jsonargparse's chain of tracebacks."""
        try:
            super().instantiate_classes()
        except Exception as error:
            cause = error
            while cause.__cause__ is not None:
                cause = cause.__cause__
            if isinstance(cause, ValueError | FileNotFoundError | UnsafeCheckpointError):
                raise SystemExit(f"lit3d {self.subcommand}: error: {cause}") from None
            raise

    def _check_model_and_data(self) -> None:
        # Before the trainer launches any process: a mismatch fails here, once, with a clear message.
        try:
            if isinstance(self.model, GPT) and self.datamodule is not None and self.subcommand != "predict":
                check_model_fits_data(self.model.config, self.datamodule)
            check_ckpt_path(self.config[self.subcommand].get("ckpt_path"))
        except (ValueError, FileNotFoundError, UnsafeCheckpointError) as error:
            raise SystemExit(f"lit3d {self.subcommand}: error: {error}") from None

    before_fit = before_validate = before_test = before_predict = _check_model_and_data

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        """Lightning's; ``fit --ckpt_path last`` is the newest complete checkpoint in the run's checkpoint folders
        (`lit3d.strategies.resume`), or a fresh start: the same command resumes a requeued job."""
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if subcommand == "fit" and kwargs.get("ckpt_path") == "last":
            folders = [Path(cb.dirpath) for cb in self.trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
            newest = newest_complete_checkpoint(folders)
            kwargs["ckpt_path"] = None if newest is None else str(newest)
        return kwargs


def _resolve_lit3d_01_strategy_path() -> None:
    """lit3d 0.1's configs name the strategy ``strategies.Parallel3DStrategy``, from the top-level module it used to
    install. Unless some other ``strategies`` module is importable, that name means `lit3d.strategies` in this
    command's process, so those configs keep working. (From a checkout, the repository's ``strategies/`` folder is
    that package itself.)"""
    if "strategies" not in sys.modules and importlib.util.find_spec("strategies") is None:
        sys.modules["strategies"] = lit3d.strategies


FLAGS = ("--json", "--verify", "--sequence_parallel", "--activation_checkpointing")
USAGE = """usage: lit3d COMMAND [--help] [arguments]

Train and plan 3D-parallel (data x tensor x pipeline) GPTs with PyTorch Lightning.

commands:
  fit        train (LightningCLI: --config configs/tiny.yaml, --trainer.*, --model.*, --data.*)
  validate   the validation loss and perplexity of a model or checkpoint
  test       the test loss and perplexity on the data's test split
  predict    continue the data's prompts (--data.prompts)
  plan       memory, communication and step time of a layout, or the best layouts of a cluster
  export     a lit3d checkpoint (any layout) as a HuggingFace Llama folder
  convert    a lit3d checkpoint folder (any layout) as one Lightning checkpoint file
  generate   print a continuation of a prompt by a checkpoint or a HuggingFace folder
  prepare    tokenize a corpus once into memory-mapped shards that training reads

'lit3d COMMAND --help' lists a command's arguments.
"""
COMMANDS = ("plan", "export", "convert", "generate", "prepare")


def _bare_flags_true(argv: list[str]) -> list[str]:
    """``--json`` alone means ``--json=true`` (jsonargparse wants a value for every bool)."""
    out = []
    for i, arg in enumerate(argv):
        bare = arg in FLAGS and (i + 1 == len(argv) or argv[i + 1].startswith("--"))
        out.append(f"{arg}=true" if bare else arg)
    return out


def _strategy_names_to_class_path(argv: list[str]) -> list[str]:
    """``--trainer.strategy=3d`` (a registered name) with ``--trainer.strategy.*`` arguments after it: jsonargparse
    needs the class path to take the arguments."""
    if not any(arg.startswith("--trainer.strategy.") for arg in argv):
        return argv  # alone, a registered name reaches Lightning's strategy registry as it is
    out = []
    for arg in argv:
        key, _, value = arg.partition("=")
        registered = key == "--trainer.strategy" and value.lower() in ("3d", "parallel3dstrategy")
        out.append(f"{key}=lit3d.strategies.Parallel3DStrategy" if registered else arg)
    return out


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv[:1] in ([], ["-h"], ["--help"]):
        print(USAGE, end="")
        return
    if argv[0] in COMMANDS:
        from jsonargparse import CLI

        from lit3d import commands

        try:
            CLI(getattr(commands, argv[0]), args=_bare_flags_true(argv[1:]), as_positional=False)
        except (ValueError, FileNotFoundError, FileExistsError, UnsafeCheckpointError) as error:  # bad input: one line
            raise SystemExit(f"lit3d {argv[0]}: error: {error}") from None
        return
    make_cli(args)


def make_cli(args: list[str] | None = None, run: bool = True) -> Lit3DCLI:
    """`Lit3DCLI` for any LightningModule and LightningDataModule (``class_path`` + ``init_args``); lit3d's are
    the defaults."""
    _resolve_lit3d_01_strategy_path()
    argv = sys.argv[1:] if args is None else args
    rewritten = _strategy_names_to_class_path(argv)
    args = rewritten if rewritten != argv else args
    return Lit3DCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


if __name__ == "__main__":
    main()
