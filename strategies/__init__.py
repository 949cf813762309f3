"""lit3d's Lightning strategy: ``Parallel3DStrategy`` (also ``strategy="3d"`` or ``strategy="Parallel3DStrategy"``;
``strategy="3d_auto"`` is ``Parallel3DStrategy(auto_layout=True)``: the planner chooses the layout at launch).

Importing this package registers those names in Lightning's strategy registry. The rules the strategy follows (the
rank grid, the schedules, the stage split, what each axis shards) are the pure `lit3d.parallel`, which the planner
imports without Lightning.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lit3d.strategies.parallel3d import Parallel3DStrategy

__all__ = ["Parallel3DStrategy"]

# Lightning looks names up in lower case; the class name also arrives here as a plain string when a command line
# gives `--trainer.strategy=Parallel3DStrategy` with no arguments.
for _name in ("3d", "parallel3dstrategy", "lit3d.strategies.parallel3dstrategy", "strategies.parallel3dstrategy"):
    if _name not in StrategyRegistry:
        StrategyRegistry.register(
            _name, Parallel3DStrategy, description="data x tensor x pipeline parallel with ZeRO (lit3d)"
        )
if "3d_auto" not in StrategyRegistry:
    StrategyRegistry.register(
        "3d_auto", Parallel3DStrategy, description="lit3d's 3D parallelism, laid out by its planner", auto_layout=True
    )
