"""lit3d's Lightning strategy: ``Parallel3DStrategy`` (also ``strategy="3d"`` or ``strategy="Parallel3DStrategy"``).

``Parallel3DStrategy`` loads on first use (PEP 562), and registers its names in Lightning's strategy registry then:
the planner imports the pure modules here (`layout`, `schedules`, ...) without importing Lightning. Name the class
once (``from lit3d import Parallel3DStrategy``) before ``Trainer(strategy="3d")``; the ``lit3d`` command does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lit3d.strategies.parallel3d import Parallel3DStrategy

__all__ = ["Parallel3DStrategy"]

# Lightning looks names up in lower case; the class name also arrives here as a plain string when a command line
# gives `--trainer.strategy=Parallel3DStrategy` with no arguments.
REGISTERED_NAMES = ("3d", "parallel3dstrategy", "lit3d.strategies.parallel3dstrategy", "strategies.parallel3dstrategy")


def __getattr__(name: str) -> Any:
    if name != "Parallel3DStrategy":
        raise AttributeError(f"module 'lit3d.strategies' has no attribute {name!r}")
    from lightning.pytorch.strategies import StrategyRegistry

    from lit3d.strategies.parallel3d import Parallel3DStrategy

    for registered in REGISTERED_NAMES:
        if registered not in StrategyRegistry:
            StrategyRegistry.register(
                registered, Parallel3DStrategy, description="data x tensor x pipeline parallel with ZeRO (lit3d)"
            )
    globals()["Parallel3DStrategy"] = Parallel3DStrategy  # later lookups find it directly
    return Parallel3DStrategy


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
