"""Uneven data parallelism: ``data_parallel_shares``, the samples of each global batch each replica computes (more on
faster GPUs). The rules a list must follow; the sampler deals the shares (`lit3d.data.sampler.GlobalBatchSampler`) and
each replica's loss is weighted by its share (`lit3d.models.runner.ReplicaShare`), so the step is the single-process
step."""

from __future__ import annotations

from typing import Any


def check_shares(shares: tuple[int, ...] | None, replicas: Any = "auto", islands: int = 1) -> None:
    """Every share a whole number of samples, at least one, one per data-parallel replica (where that is known)."""
    if shares is None:
        return
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in shares):
        raise ValueError(f"data_parallel_shares={list(shares)} must be whole numbers of samples, each at least 1")
    if isinstance(replicas, int) and len(shares) != replicas:
        raise ValueError(
            f"data_parallel_shares={list(shares)} has {len(shares)} shares for data_parallel_size={replicas} replicas"
        )
    if islands > 1:
        raise ValueError(
            f"data_parallel_shares={list(shares)} with islands={islands}: DiLoCo's islands split their replicas evenly"
        )


def check_shares_fit(shares: tuple[int, ...] | None, replicas: int, global_batch_size: int | None, steps: int) -> None:
    """The shares against the run: one per replica, summing to the global batch, each a whole number of ``steps``
    micro-batches (gradient accumulation's micro-steps x a pipeline's micro-batches), which every replica runs."""
    if shares is None:
        return
    check_shares(shares, replicas)
    if global_batch_size is not None and sum(shares) != global_batch_size:
        raise ValueError(
            f"data_parallel_shares={list(shares)} sums to {sum(shares)} samples, not the "
            f"global_batch_size={global_batch_size}"
        )
    uneven = [n for n in shares if n % steps]
    if uneven:
        raise ValueError(
            f"data_parallel_shares={list(shares)}: {uneven} not whole numbers of the {steps} "
            "micro-batches each replica runs per step"
        )


def share_weight(shares: tuple[int, ...], replica: int) -> float:
    """What replica ``replica``'s mean loss is multiplied by, so that the replicas' average (what data parallelism
    reduces) is the mean over the global batch: its share over an even one."""
    return shares[replica] * len(shares) / sum(shares)
