"""A misspelt name given to ``lit3d fit|validate|test|predict`` and the accepted name nearest to it: a strategy's name
(`lit3d.cli.strategy_names`), and a key of the model, the data, the trainer or its strategy, on the command line or in
a ``--config``.

NOTE: jsonargparse refuses an unknown key by printing the command's usage (45 lines) and, in the model's or the data's
section, its error for each type the section could be ("Does not validate against any of the Union subtypes").
`unknown_key_refusal` reads which key that error names and where, and says it in one line.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Collection, Iterable
from typing import Any

from jsonargparse import ArgumentParser

UNRECOGNIZED = "unrecognized arguments: "  # a flag of no section's class: ``--trainer.max_stepz=3``
CONFIG_KEY = re.compile(r"^Subcommand '[^']+' does not accept option '([^']+)'")  # a config's ``trainer: max_stepz:``
SECTION = re.compile(r'^Parser key "([^"]+)"')  # a section whose class is chosen: model, data, trainer.strategy
CLASS_PATH = re.compile(r"class_path '([^']+)'")
NOT_ACCEPTED = re.compile(r"Option '([^']+)' is not accepted")
HELP = "--help lists the accepted ones"


def nearest(typed: str, names: Iterable[str]) -> str | None:
    """The name of ``names`` that ``typed`` most likely means: the first that begins with it, else the closest by
    difflib's ratio (0.6 or more); compared in lower case, returned as listed. None if none is near."""
    by_lower = {name.lower(): name for name in names}
    starting = [name for lower, name in by_lower.items() if typed and lower.startswith(typed.lower())]
    close = difflib.get_close_matches(typed.lower(), by_lower, n=1, cutoff=0.6)
    return starting[0] if starting else (by_lower[close[0]] if close else None)


def unknown_key_refusal(message: str, parser: Any, args: list[str]) -> str | None:
    """The line naming each key that jsonargparse's error ``message`` (of ``parser`` parsing ``args``) says nothing
    accepts, with the accepted name nearest to it; None for any other error."""
    if message.startswith(UNRECOGNIZED):
        flags = [arg.partition("=")[0] for arg in message.removeprefix(UNRECOGNIZED).split() if arg.startswith("--")]
        return "; ".join(_sibling_guess("argument", flag, parser._option_string_actions) for flag in flags) or None
    if match := CONFIG_KEY.match(message):
        return _sibling_guess("key", match[1], [action.dest for action in parser._actions], " in the config")
    section, option = SECTION.match(message), NOT_ACCEPTED.search(message)
    classes = CLASS_PATH.findall(message[: option.start()]) if option else []
    if section is None or not classes:
        return None
    key, accepted = option[1], class_arguments(classes[-1])
    guess = nearest(key, accepted)
    typed = next((a.partition("=")[0] for a in args if _names(a.partition("=")[0], section[1], key)), None)
    if typed is None:  # from a config file
        said = f"unknown key {key!r} of {section[1]} ({classes[-1]}) in the config"
        return f"{said}: did you mean {guess!r}?" if guess else f"{said}; {HELP}"
    said = f"unknown argument {typed}"
    return f"{said}: did you mean {typed.removesuffix(key)}{guess}?" if guess else f"{said}; {HELP}"


def class_arguments(class_path: str) -> list[str]:
    """The arguments jsonargparse accepts for ``class_path``'s ``init_args`` (none if it cannot be imported)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "init_args", fail_untyped=False)
    names = [action.dest.removeprefix("init_args.") for action in parser._actions]
    return [name for name in names if "." not in name and name not in ("help", "init_args")]


def _sibling_guess(kind: str, key: str, accepted: Collection[str], where: str = "") -> str:
    """``unknown KIND KEY``, with the nearest of the names beside it (the same section's), else of all ``accepted``
    (a misspelt section: ``trainr.max_steps``)."""
    parent, _, last = key.rpartition(".")
    beside = nearest(last, [name.rpartition(".")[2] for name in accepted if name.rpartition(".")[0] == parent])
    guess = key.removesuffix(last) + beside if beside else nearest(key, accepted)
    said = f"unknown {kind} {key}{where}"
    return f"{said}: did you mean {guess}?" if guess else f"{said}; {HELP}"


def _names(flag: str, section: str, key: str) -> bool:
    """Whether the command line's ``flag`` gives ``key`` in ``section`` (``--model.lr``, ``--model.init_args.lr``,
    ``--model.init_args.config.lr``)."""
    return flag.startswith(f"--{section}.") and flag.endswith(f".{key}")
