"""The depth cut into pipeline stages, as arithmetic on block indices: which blocks each chunk runs, and which
pipeline rank holds each chunk.

The network's decoder blocks ``0..N-1`` are cut into ``pp × virtual`` chunks of consecutive blocks, balanced by cost
(parameter elements, the same as the matmul FLOPs per token of blocks and head; `partition`); chunk ``s`` lives on
pipeline rank ``s % pp``, or for the V-shaped schedules (two chunks per rank) rank ``r`` holds chunks ``r`` and
``2·pp - 1 - r`` (`chunk_stage_ids`). The first chunk also runs the parts before the blocks (an embedding), the last
those after them (final norm, head). As Llama 3 405B ran (126 blocks on 16 × 8 = 128 stages, "the first and the last
stage one layer less"), the first and the last chunk may hold no block: the embedding or the head takes its place.
Cut by cost, that is how one or two chunks more than blocks are cut (`stage_runs`).

No torch here: the planner cuts with these rules from the model's shapes alone. The chunk modules themselves (views
of an ``nn.Module`` network) are `lit3d.strategies.pipelining.chunks`.
"""

from __future__ import annotations


def partition(
    costs: list[float], first_extra: float, last_extra: float, chunks: int, speeds: list[float] | None = None
) -> list[list[int]]:
    """Cut blocks ``0..N-1`` (with ``costs``) into ``chunks`` consecutive, non-empty runs, minimising the
    largest run cost; the first run also pays ``first_extra`` (the embedding), the last ``last_extra`` (the
    head). ``speeds``: each chunk's device speed, a run's cost divided by it (a fleet's GPUs of different kinds).
    Exact dynamic programme over cut points."""
    n = len(costs)
    if not 1 <= chunks <= n:
        raise ValueError(f"cannot cut {n} blocks into {chunks} pipeline chunks")
    speeds = speeds or [1.0] * chunks
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def run_cost(i: int, j: int, k: int) -> float:  # blocks i..j-1 as chunk k
        cost = prefix[j] - prefix[i] + (first_extra if k == 0 else 0) + (last_extra if k == chunks - 1 else 0)
        return cost / speeds[k]

    # best[k][j]: minimal largest cost of cutting blocks 0..j-1 into k+1 chunks; cut[k][j]: start of chunk k.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(chunks)]
    cut = [[0] * (n + 1) for _ in range(chunks)]
    for j in range(1, n + 1):
        best[0][j] = run_cost(0, j, 0)
    for k in range(1, chunks):
        # NOTE: `run_cost` written out, and no chunk k ending where too few blocks are left for the chunks after it:
        # the planner cuts every model at every chunk count, and these loops were its slowest part. Chunk k's start
        # ``i`` is tried from the last down: its own cost only grows as ``i`` falls (costs are not negative), so
        # once it passes the best found, no earlier start can beat it; ties keep the earliest start.
        extra, speed = last_extra if k == chunks - 1 else 0, speeds[k]
        previous, row, starts = best[k - 1], best[k], cut[k]
        for j in range(k + 1, n - (chunks - 1 - k) + 1):
            end = prefix[j]
            for i in range(j - 1, k - 1, -1):
                own = (end - prefix[i] + extra) / speed
                if own > row[j]:
                    break
                value = max(previous[i], own)
                if value <= row[j]:
                    row[j], starts[j] = value, i
    bounds, j = [], n
    for k in range(chunks - 1, 0, -1):
        i = cut[k][j]
        bounds.append((i, j))
        j = i
    bounds.append((0, j))
    return [list(range(i, j)) for i, j in reversed(bounds)]


def stage_runs(
    costs: list[float], first_extra: float, last_extra: float, chunks: int, layers: tuple[int, ...] | None = None
) -> list[list[int]]:
    """The blocks of each of ``chunks`` stages: ``layers`` blocks each, in order, where given (uneven stages for
    GPUs of different speeds or memory: `pipeline_stage_layers`), else cut by cost (`partition`)."""
    if layers is None:
        layers = end_layers(len(costs), chunks)  # (None unless the ends must take stages of their own)
    if layers is None:
        return partition(costs, first_extra, last_extra, chunks)
    check_stage_layers(layers, len(costs), chunks)
    starts = [sum(layers[:i]) for i in range(len(layers))]
    return [list(range(start, start + n)) for start, n in zip(starts, layers)]


def end_layers(n_layer: int, chunks: int) -> tuple[int, ...] | None:
    """One block per chunk where there are one or two chunks more than blocks: the head alone on the last chunk, and
    with two more the embedding alone on the first too (Llama 3 405B's cut); None where every chunk gets a block."""
    if chunks <= n_layer or chunks > n_layer + 2:
        return None
    ends = chunks - n_layer
    return (0,) * (ends - 1) + (1,) * n_layer + (0,)


def check_stage_layers(layers: tuple[int, ...] | None, n_layer: int | None, chunks: int) -> None:
    """``pipeline_stage_layers`` names a whole number of blocks for every one of the ``chunks`` stages, each at least
    one but the first and the last (the embedding or the head in place of a block), and (where the model is known)
    all of its ``n_layer`` blocks; refused naming the values."""
    if layers is None:
        return
    whole = len(layers) == chunks and all(isinstance(n, int) and not isinstance(n, bool) for n in layers)
    if not whole or any(n < (0 if i in (0, chunks - 1) else 1) for i, n in enumerate(layers)) or not any(layers):
        raise ValueError(
            f"pipeline_stage_layers={list(layers)} must give each of the {chunks} pipeline stages "
            "(pipeline_parallel_size x chunks per rank) a whole number of blocks, at least 1 (0 for the first and "
            "the last, whose embedding or head takes a block's place)"
        )
    if n_layer is not None and sum(layers) != n_layer:
        raise ValueError(
            f"pipeline_stage_layers={list(layers)} sums to {sum(layers)} blocks, but the model has n_layer={n_layer}"
        )


def chunk_stage_ids(rank: int, pp: int, virtual: int, placement: str = "loop") -> list[int]:
    """Global stage indices held by pipeline rank ``rank``: ``"loop"``, stage s on rank s % pp; ``"v"`` (two chunks
    per rank, the V-shaped schedules), stages ``rank`` and ``2·pp - 1 - rank``, so the last stage is on rank 0."""
    if placement == "v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + v * pp for v in range(virtual)]


def stage_rank(stage: int, pp: int, placement: str = "loop") -> int:
    """The pipeline rank that holds global stage ``stage`` (the inverse of `chunk_stage_ids`)."""
    if placement == "v" and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp
