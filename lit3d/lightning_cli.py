"""The LightningCLI behind ``lit3d fit|validate|test|predict``: `Lit3DCLI`, loaded by `lit3d.cli.make_cli` only for
those commands (``lit3d --help`` and ``lit3d plan`` import no Lightning)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import (
    BasePredictionWriter,
    Callback,
    LearningRateMonitor,
    ModelSummary,
    ProgressBar,
)
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

import lit3d.strategies
from lit3d.callbacks import ModelSummary as WholeModelSummary
from lit3d.callbacks import PrintCompletions, RichProgress, Throughput
from lit3d.gpt import GPT, check_model_fits_data
from lit3d.strategies import Parallel3DStrategy  # NOTE: naming it registers "3d" (see lit3d.strategies)
from lit3d.strategies.checkpoint import ShardedCheckpointReader, check_ckpt_path
from lit3d.strategies.checks import ConfigurationError
from lit3d.strategies.resume import newest_complete_checkpoint
from lit3d.strategies.safe_io import UnsafeCheckpointError

__all__ = ["Lit3DCLI", "Parallel3DStrategy", "resolve_lit3d_01_strategy_path"]


class Lit3DCLI(LightningCLI):
    """LightningCLI with lit3d's defaults: the tiny GPT on the embedded corpus, a Rich progress bar when
    interactive, a model summary of the whole model in every layout, the `Throughput` callback (tokens/s, MFU) unless
    the config has one, `PrintCompletions` for ``predict``, and a checkpoint reader that also takes lit3d's sharded
    folders under any strategy; bad input ends the command with one line naming it."""

    def _add_subcommands(self, parser: Any, **kwargs: Any) -> None:
        """Lightning's; each command's usage line reads ``usage: lit3d fit ...``, as its errors do (jsonargparse names
        a subcommand after its parent's ``prog``, the script's file name, and the parent's ``[options]``)."""
        super()._add_subcommands(parser, **kwargs)
        for subcommand, subcommand_parser in self._subcommand_parsers.items():
            subcommand_parser.prog = f"lit3d {subcommand}"

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Lightning's, on the command line with registered strategy names as class paths (`strategy_class_paths`).
        NOTE: the rewritten command line is parsed here rather than handed to LightningCLI as ``args``, which it
        would take for a second command line and warn about, printing the whole argv."""
        if args is None:
            self.config = parser.parse_args(strategy_class_paths(sys.argv[1:]))
            return
        super().parse_arguments(parser, strategy_class_paths(args) if isinstance(args, list) else args)

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
            callbacks = [*callbacks, RichProgress()]
        summary = config.get("enable_model_summary") is not False and not config.get("barebones")
        if summary and not any(isinstance(c, ModelSummary) for c in given):
            # NOTE: the whole model's count in every layout; Lightning's default would count rank 0's share, and
            # would say it skips its own if the flag stayed set
            callbacks, config["enable_model_summary"] = [*callbacks, WholeModelSummary()], False
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
            cause = self._strategy_refusal() or cause
            if isinstance(cause, ValueError | FileNotFoundError | UnsafeCheckpointError):
                raise SystemExit(f"lit3d {self.subcommand}: error: {cause}") from None
            raise

    def _strategy_refusal(self) -> Exception | None:
        """The error of building ``trainer.strategy`` alone (its constructor refusing a value), or None.

        NOTE: jsonargparse tries each alternative of the trainer's ``strategy: str | Strategy`` and reports the
        first one's error ("Expected a <class 'str'>"), not the strategy's own ("zero_stage=5 must be 0, 1, 2 or 3")."""
        spec = self._get(self.config, "trainer", {}).get("strategy")
        if not isinstance(spec, Namespace) or not isinstance(spec.get("class_path"), str):
            return None
        module, _, name = spec.class_path.rpartition(".")
        try:
            getattr(importlib.import_module(module), name)(**(spec.get("init_args") or {}))
        except Exception as error:
            return error
        return None

    def _run_subcommand(self, subcommand: str) -> None:
        """Lightning's; a layout the strategy refuses before any rank starts ends the command with its one line."""
        try:
            super()._run_subcommand(subcommand)
        except ConfigurationError as error:
            raise SystemExit(f"lit3d {subcommand}: error: {error}") from None

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


def resolve_lit3d_01_strategy_path() -> None:
    """lit3d 0.1's configs name the strategy ``strategies.Parallel3DStrategy``, from the top-level module it used to
    install. Unless some other ``strategies`` module is importable, that name means `lit3d.strategies` in this
    command's process, so those configs keep working. (From a checkout, the repository's ``strategies/`` folder is
    that package itself.)"""
    if "strategies" not in sys.modules and importlib.util.find_spec("strategies") is None:
        sys.modules["strategies"] = lit3d.strategies


def strategy_class_paths(argv: list[str]) -> list[str]:
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
