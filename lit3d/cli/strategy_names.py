"""The strategy names ``--trainer.strategy`` takes, and the refusal of one that names nothing: which names lit3d
registers, Lightning's own, and the closest to what was typed (`lit3d.cli.misspelt.nearest`).

NOTE: Lightning refuses an unknown name late (after the model summary's setup, in lower case, listing four of its own
names and none of lit3d's), and jsonargparse refuses one given with ``--trainer.strategy.*`` arguments by printing its
parser's state; both come here first.
"""

from __future__ import annotations

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lit3d.cli.misspelt import nearest
from lit3d.strategies import Parallel3DStrategy  # NOTE: importing it registers lit3d's names

SHOWN_AS = {"parallel3dstrategy": "Parallel3DStrategy"}  # Lightning keeps names in lower case
COMMANDS = ("fit", "validate", "test", "predict")
VARIANTS = ("find_unused", "stage", "offload", "notebook", "fork", "xla", "tpu")  # of Lightning's names, not listed


def registered_names() -> tuple[list[str], list[str]]:
    """(lit3d's names, Lightning's main ones), as a user types them; variants of a name (``ddp_find_unused_...``,
    ``deepspeed_stage_2``, a class's dotted paths) and the TPU ones left out."""
    ours, theirs = [], ["auto"]
    for name in StrategyRegistry.available_strategies():
        if "." in name or any(variant in name for variant in VARIANTS):
            continue
        is_ours = issubclass(StrategyRegistry[name]["strategy"], Parallel3DStrategy)
        (ours if is_ours else theirs).append(SHOWN_AS.get(name, name))
    return ours, theirs


def strategy_name_refusal(name: str) -> str | None:
    """Why ``--trainer.strategy=NAME`` names no strategy, with the closest registered name; None for a registered
    name, a class path (``x.y.Strategy``) or a `Strategy` class's name, which jsonargparse resolves."""
    registered = {"auto", *StrategyRegistry.available_strategies()}
    if "." in name or name.lower() in registered or name in _strategy_class_names():
        return None
    ours, theirs = registered_names()
    guess = nearest(name, [*ours, *theirs])
    return (
        f"trainer.strategy={name!r} names no strategy"
        + (f": did you mean {guess!r}?" if guess else ".")
        + f" lit3d registers {', '.join(ours)} (lit3d.strategies.Parallel3DStrategy: data x tensor x pipeline "
        f"parallel); Lightning: {', '.join(theirs)}, ...; or a Strategy's class path"
    )


def check_strategy_names(argv: list[str]) -> None:
    """End the command with `strategy_name_refusal`'s line if ``--trainer.strategy`` names no strategy."""
    for i, arg in enumerate(argv):
        key, equals, value = arg.partition("=")
        if key != "--trainer.strategy" or not (equals or i + 1 < len(argv)):
            continue
        refusal = strategy_name_refusal(value if equals else argv[i + 1])
        if refusal is not None:
            command = next((f"lit3d {a}" for a in argv if a in COMMANDS), "lit3d")
            raise SystemExit(f"{command}: error: {refusal}")


def _strategy_class_names() -> set[str]:
    """The names of the `Strategy` classes imported so far (``DDPStrategy``, ``Parallel3DStrategy``, ...)."""
    names, pending = set(), [Strategy]
    while pending:
        cls = pending.pop()
        names.add(cls.__name__)
        pending.extend(cls.__subclasses__())
    return names
