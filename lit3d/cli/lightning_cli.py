"""The LightningCLI behind ``lit3d fit|validate|test|predict``: `Lit3DCLI`, loaded by `lit3d.cli.make_cli` only for
those commands (``lit3d --help`` and ``lit3d plan`` import no Lightning)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, NoReturn

from jsonargparse import Namespace
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import (
    BasePredictionWriter,
    Callback,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    RichProgressBar,
)
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

import lit3d.strategies
from lit3d.callbacks import ModelSummary as WholeModelSummary
from lit3d.callbacks import PrintCompletions, RichProgress, Throughput
from lit3d.checkpoint.folder import (
    ShardedCheckpointReader,
    check_ckpt_path,
    is_sharded_checkpoint,
    resume_refusal,
)
from lit3d.checkpoint.resume import checkpoint_folders, newest_complete_checkpoint
from lit3d.checkpoint.safe_io import UnsafeCheckpointError
from lit3d.cli.misspelt import unknown_key_refusal
from lit3d.cli.strategy_names import check_strategy_names, strategy_name_refusal
from lit3d.data.batches import GlobalBatchData
from lit3d.errors import ConfigurationError
from lit3d.models.config import check_model_fits_data
from lit3d.models.gpt import GPT
from lit3d.shipped import find_config, shipped_configs
from lit3d.strategies import Parallel3DStrategy  # NOTE: naming it registers "3d" (see lit3d.strategies)

__all__ = ["Lit3DCLI", "Parallel3DStrategy", "resolve_lit3d_01_strategy_path"]


class Lit3DArgumentParser(LightningArgumentParser):
    """Lightning's parser; a misspelt key of the model, the data, the trainer or its strategy ends the command with
    one line naming it and the nearest accepted one (`unknown_key_refusal`), exit status 2 as argparse's."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if self.exit_on_error:  # (the parsers jsonargparse makes for a class's arguments raise, to try the next type)
            parser = getattr(ex, "subcommand_parser", None) or self  # (a config's key: the command's own parser)
            line = unknown_key_refusal(message, parser, getattr(self, "args", None) or [])
            if line is not None:
                self.exit(2, f"{parser.prog}: error: {line}\n")
        super().error(message, ex)


class Lit3DCLI(LightningCLI):
    """LightningCLI with lit3d's defaults: the tiny GPT on the embedded corpus, lit3d's Rich progress bar when
    interactive (and in place of Lightning's default Rich one), a model summary of the whole model in every layout,
    the `Throughput` callback (tokens/s, MFU) unless the config has one, `PrintCompletions` for ``predict``, and a
    checkpoint reader that also takes lit3d's sharded folders under any strategy; bad input ends the command with one
    line naming it."""

    def __init__(self, *args: Any, parser_class: type = Lit3DArgumentParser, **kwargs: Any) -> None:
        super().__init__(*args, parser_class=parser_class, **kwargs)

    def _add_subcommands(self, parser: Any, **kwargs: Any) -> None:
        """Lightning's; each command's usage line reads ``usage: lit3d fit ...``, as its errors do (jsonargparse names
        a subcommand after its parent's ``prog``, the script's file name, and the parent's ``[options]``)."""
        super()._add_subcommands(parser, **kwargs)
        for subcommand, subcommand_parser in self._subcommand_parsers.items():
            subcommand_parser.prog = f"lit3d {subcommand}"

    def init_parser(self, **kwargs: Any) -> Any:
        """Lightning's; ``--config`` also takes the name of a config shipped with lit3d, which its help lists."""
        parser = super().init_parser(**kwargs)
        config = next(action for action in parser._actions if action.dest == "config")
        config.help = f"A YAML config file, or the name of one shipped with lit3d: {', '.join(shipped_configs())}."
        return parser

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Lightning's, on the command line with registered strategy names as class paths (`strategy_class_paths`)
        and shipped configs' names as their files (`shipped_config_paths`).
        NOTE: the rewritten command line is parsed here rather than handed to LightningCLI as ``args``, which it
        would take for a second command line and warn about, printing the whole argv."""
        if args is None:
            self.config = parser.parse_args(strategy_class_paths(shipped_config_paths(sys.argv[1:])))
            return
        argv = strategy_class_paths(shipped_config_paths(args)) if isinstance(args, list) else args
        super().parse_arguments(parser, argv)

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
        bar_given = any(isinstance(c, ProgressBar) for c in given)
        default_bar = config.get("enable_progress_bar") is not False and not bar_given
        if default_bar and sys.stdout.isatty():
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
            callbacks = _leave_out(config, callbacks, LearningRateMonitor)
        if config.get("enable_checkpointing") is False:  # the configs' own ModelCheckpoint goes with the flag
            callbacks = _leave_out(config, callbacks, ModelCheckpoint)
        plugins = config.get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):  # lit3d's folders load under any strategy
            config["plugins"] = [*plugins, ShardedCheckpointReader()]
        trainer = super()._instantiate_trainer(config, callbacks)
        bar = trainer.progress_bar_callback
        if default_bar and type(bar) is RichProgressBar:  # Lightning's own default (from 2.6, where Rich is installed)
            trainer.callbacks[trainer.callbacks.index(bar)] = RichProgress()
        return trainer

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
        if isinstance(spec, str) and strategy_name_refusal(spec) is not None:  # a config's name for no strategy
            return ValueError(strategy_name_refusal(spec))
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
                check_model_fits_data(self.model.config, self.datamodule, self.model)
            validates = self.subcommand != "fit" or self.trainer.limit_val_batches != 0
            if isinstance(self.datamodule, GlobalBatchData) and self.subcommand != "predict":
                self.datamodule.check_sizes(self.subcommand, self.trainer.accumulate_grad_batches, validates)
            check_ckpt_path(
                self.config[self.subcommand].get("ckpt_path"), self.model if self.subcommand == "fit" else None
            )
        except (ValueError, FileNotFoundError, UnsafeCheckpointError) as error:
            raise SystemExit(f"lit3d {self.subcommand}: error: {error}") from None

    before_fit = before_validate = before_test = before_predict = _check_model_and_data

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        """Lightning's; ``fit --ckpt_path last`` is the newest complete checkpoint in the run's checkpoint folders, its
        earlier versions' included (`lit3d.checkpoint.resume`), or a fresh start: the same command resumes a requeued
        job. A lit3d checkpoint folder that another strategy would resume, without its optimizer, is refused here."""
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if subcommand == "fit" and kwargs.get("ckpt_path") == "last":
            try:
                newest = newest_complete_checkpoint(checkpoint_folders(self.trainer))
            except ValueError as error:
                raise SystemExit(f"lit3d {subcommand}: error: {error}") from None
            kwargs["ckpt_path"] = None if newest is None else str(newest)
        strategy, ckpt_path = self.trainer.strategy, kwargs.get("ckpt_path")
        reader = isinstance(strategy.checkpoint_io, ShardedCheckpointReader) and strategy.lightning_restore_optimizer
        elsewhere = reader and not isinstance(strategy, Parallel3DStrategy)  # resumes a folder through the reader
        if subcommand == "fit" and ckpt_path and is_sharded_checkpoint(ckpt_path) and elsewhere:
            raise SystemExit(f"lit3d {subcommand}: error: {resume_refusal(ckpt_path, type(strategy).__name__)}")
        return kwargs


def _leave_out(config: dict[str, Any], callbacks: list[Callback], kind: type) -> list[Callback]:
    """``callbacks`` without those of ``kind``, which leave the trainer's configured ones too."""
    if isinstance(config.get("callbacks"), list):
        config["callbacks"] = [c for c in config["callbacks"] if not isinstance(c, kind)]
    elif isinstance(config.get("callbacks"), kind):
        config["callbacks"] = []
    return [c for c in callbacks if not isinstance(c, kind)]


def resolve_lit3d_01_strategy_path() -> None:
    """lit3d 0.1's configs name the strategy ``strategies.Parallel3DStrategy``, from the top-level module it used to
    install. Unless some other ``strategies`` module is importable, that name means `lit3d.strategies` in this
    command's process, so those configs keep working. (From a checkout, the repository's ``strategies/`` folder is
    that package itself.)"""
    if "strategies" not in sys.modules and importlib.util.find_spec("strategies") is None:
        sys.modules["strategies"] = lit3d.strategies


def shipped_config_paths(argv: list[str]) -> list[str]:
    """``--config NAME`` (or ``-c``) naming no file but a config shipped with lit3d (`lit3d.shipped`): its file, so
    ``lit3d fit --config tiny`` works from any folder. A missing ``configs/NAME.yaml`` of a shipped config is refused
    with the name to give."""
    out = list(argv)
    for i, arg in enumerate(argv):
        key, equals, value = arg.partition("=")
        at = i if equals else i + 1
        if key not in ("-c", "--config") or at == len(argv):
            continue
        value = value if equals else argv[at]
        if Path(value).exists():
            continue
        found = find_config(value)
        if found is None and Path(value).stem in shipped_configs():
            command = "lit3d " + argv[0] if not argv[0].startswith("-") else "lit3d"
            raise SystemExit(
                f"{command}: error: --config {value}: no such file; a config shipped with lit3d is found by its "
                f"name: --config {Path(value).stem}"
            )
        if found is not None:
            out[at] = f"{key}={found}" if equals else str(found)
    return out


def strategy_class_paths(argv: list[str]) -> list[str]:
    """``--trainer.strategy=3d`` (a registered name) with ``--trainer.strategy.*`` arguments after it: jsonargparse
    needs the class path to take the arguments. A name that names no strategy is refused (`check_strategy_names`)."""
    check_strategy_names(argv)
    if not any(arg.startswith("--trainer.strategy.") for arg in argv):
        return argv  # alone, a registered name reaches Lightning's strategy registry as it is
    out = []
    for arg in argv:
        key, _, value = arg.partition("=")
        registered = key == "--trainer.strategy" and value.lower() in ("3d", "parallel3dstrategy", "3d_auto")
        out.append(f"{key}=lit3d.strategies.Parallel3DStrategy" if registered else arg)
        if registered and value.lower() == "3d_auto":  # the registered name's own argument
            out.append("--trainer.strategy.auto_layout=true")
    return out
