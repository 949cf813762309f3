"""lit3d's Lightning strategy: ``Parallel3DStrategy`` (also ``strategy="3d"``)."""

from lightning.pytorch.strategies import StrategyRegistry

from strategies.parallel3d import Parallel3DStrategy

__all__ = ["Parallel3DStrategy"]

if "3d" not in StrategyRegistry:
    StrategyRegistry.register(
        "3d", Parallel3DStrategy, description="data x tensor x pipeline parallel with ZeRO (lit3d)"
    )
