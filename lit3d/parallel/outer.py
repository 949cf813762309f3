"""DiLoCo's outer-loop settings (`lit3d.strategies.optim.diloco` runs the loop): what no run could use, named."""

from __future__ import annotations

OUTER_REDUCE_DTYPE_NAMES = ("float32", "bfloat16")


def check_outer_loop(
    islands: int, sync_every: int, outer_lr: float, outer_momentum: float, fragments: int, reduce_dtype: str
) -> None:
    """DiLoCo's settings that no run could use, named (the strategy's constructor asks)."""
    for name, value in (("islands", islands), ("sync_every", sync_every), ("outer_fragments", fragments)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if not isinstance(outer_lr, int | float) or isinstance(outer_lr, bool) or not outer_lr > 0:
        raise ValueError(f"outer_lr={outer_lr!r} must be a number > 0 (DiLoCo's paper uses 0.7)")
    if not isinstance(outer_momentum, int | float) or not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum={outer_momentum!r} must be in [0, 1) (DiLoCo's paper uses 0.9)")
    if fragments > sync_every:
        raise ValueError(
            f"outer_fragments={fragments} is more than sync_every={sync_every}: streaming DiLoCo syncs one fragment "
            "at a time, each once every sync_every steps"
        )
    if reduce_dtype not in OUTER_REDUCE_DTYPE_NAMES:
        raise ValueError(f"outer_reduce_dtype={reduce_dtype!r} is not one of {', '.join(OUTER_REDUCE_DTYPE_NAMES)}")
