"""lit3d's command line: ``lit3d fit|validate|test|predict --config ...`` (LightningCLI), and ``lit3d plan``,
``export``, ``convert``, ``generate`` (`lit3d.cli.commands`).

Installed as the ``lit3d`` console script; ``python cli.py ...`` from a checkout does the same.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from lit3d import __version__

# NOTE: nothing heavy at the top: `lit3d --help` imports no torch and `lit3d plan` no Lightning. The LightningCLI
# (`lit3d.cli.lightning_cli`) loads in `make_cli`, the other commands in `main`.
from lit3d.cli import help_cache
from lit3d.cli.commands import SWITCHES
from lit3d.errors import UnsafeCheckpointError
from lit3d.quiet import quiet_lightning

if TYPE_CHECKING:
    from lit3d.cli.lightning_cli import Lit3DCLI


# and the settings that may be true (`lit3d.cli.commands.SWITCHES`)
FLAGS = ("--json", "--verify", "--adapter", "--search", "--chat", "--overwrite")
USAGE = """usage: lit3d COMMAND [--help] [arguments]
       lit3d --version

Train and plan 3D-parallel (data x tensor x pipeline) GPTs with PyTorch Lightning.

commands:
  fit        train (LightningCLI: --config configs/tiny.yaml, --trainer.*, --model.*, --data.*)
  validate   the validation loss and perplexity of a model or checkpoint
  test       the test loss and perplexity on the data's test split
  predict    continue the data's prompts (--data.prompts)
  plan       memory, communication and step time of a layout, or the best layouts of a cluster
  calibrate  measure this machine as the planner's clock sees a device (lit3d plan --gpu cpu.json)
  export     a lit3d checkpoint (any layout) as a HuggingFace folder of its family (Llama, Qwen, Mistral)
  convert    a lit3d checkpoint folder (any layout) as one Lightning checkpoint file
  generate   print a continuation of a prompt by a checkpoint or a HuggingFace folder
  prepare    tokenize a corpus once into memory-mapped shards that training reads

'lit3d COMMAND --help' lists a command's arguments.
"""
COMMANDS = ("plan", "calibrate", "export", "convert", "generate", "prepare")


def _bare_flags_true(argv: list[str]) -> list[str]:
    """``--json`` alone means ``--json=true`` (jsonargparse wants a value for every bool), as does a setting of the
    strategy that may be true (``lit3d plan --async_checkpoint``)."""
    flags = {*FLAGS, *SWITCHES}
    out = []
    for i, arg in enumerate(argv):
        bare = arg in flags and (i + 1 == len(argv) or argv[i + 1].startswith("--"))
        out.append(f"{arg}=true" if bare else arg)
    return out


def version() -> str:
    """``lit3d --version``: lit3d's, and what it runs on from the installed packages' metadata (no torch import)."""
    import platform
    from importlib import metadata

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    runs_on = f"Python {platform.python_version()}, torch {installed('torch')}, lightning {installed('lightning')}"
    return f"lit3d {__version__} ({runs_on})"


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv[:1] in ([], ["-h"], ["--help"]):
        print(USAGE, end="")
        return
    if argv[:1] in (["-V"], ["--version"]):
        print(version())
        return
    quiet_lightning()
    if argv[0] in COMMANDS:
        from jsonargparse import CLI

        from lit3d.cli import commands

        try:
            command, arguments = getattr(commands, argv[0]), _bare_flags_true(argv[1:])
            if argv[0] == "plan":  # NOTE: its --config is a `lit3d fit` config, which jsonargparse's CLI would drop
                from lit3d.cli.plan_command import command_line

                command_line(arguments)
            else:
                CLI(command, args=arguments, as_positional=False, prog=f"lit3d {argv[0]}")
        except (ValueError, FileNotFoundError, FileExistsError, IsADirectoryError, UnsafeCheckpointError) as error:
            # bad input (`lit3d.outputs`' refusals too): one line
            raise SystemExit(f"lit3d {argv[0]}: error: {error}") from None
        return
    if help_cache.is_help(argv):  # NOTE: answered from a cache when asked before: building it loads Lightning and torch
        help_cache.answer(argv, lambda: make_cli(args))
        return
    make_cli(args)
    if args is None:  # the program's end (in Python, the process group stays for the caller, as under Lightning)
        _end_process_groups()


def _end_process_groups() -> None:
    """NOTE: ended here, before Python's shutdown, which would destroy them in any order: a gloo group's threads
    destroyed while still joinable abort the process ("terminate called without an active exception")."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def make_cli(args: list[str] | None = None, run: bool = True) -> Lit3DCLI:
    """`Lit3DCLI` for any LightningModule and LightningDataModule (``class_path`` + ``init_args``); lit3d's are
    the defaults."""
    from lightning.pytorch import LightningDataModule, LightningModule

    from lit3d.cli.lightning_cli import Lit3DCLI, resolve_lit3d_01_strategy_path

    resolve_lit3d_01_strategy_path()
    quiet_lightning()
    return Lit3DCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def __getattr__(name: str) -> Any:
    if name == "Lit3DCLI":  # where it lived before the split; loading it imports Lightning
        from lit3d.cli.lightning_cli import Lit3DCLI

        return Lit3DCLI
    raise AttributeError(f"module 'lit3d.cli' has no attribute {name!r}")


if __name__ == "__main__":
    main()
