"""A replay of a pipeline schedule: PyTorch's own order of actions, every rank's, run with given durations and free
communication. It is the theory's check (tests/test_pipeline.py) and `pipeline_bubble.py`'s middle column: where the
measured bubble and the replay differ, the runtime costs something; where the replay and the theory differ, the
schedule's order is out of its paper's regime.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable


def order_of(schedule, name: str, p: int, m: int) -> dict:
    """Every rank's actions in the order ``schedule`` runs them.

    NOTE: PyTorch's single-stage schedules run their own loop; their ``pipeline_order`` only describes it, and in
    torch 2.13 Schedule1F1B's is off by one micro-batch from rank 1 on. Its order, as it runs: rank r first runs
    p - r forwards, then a backward and a forward in turn.
    """
    from torch.distributed.pipelining.schedules import _Action
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    if name != "1f1b":
        return schedule.pipeline_order
    order = {}
    for r in range(p):
        warm_up = min(m, p - r)
        order[r] = [_Action(r, Kind.FORWARD, i) for i in range(warm_up)]
        for i in range(m):
            order[r].append(_Action(r, Kind.FULL_BACKWARD, i))
            if warm_up + i < m:
                order[r].append(_Action(r, Kind.FORWARD, warm_up + i))
    return order


def replay(order: dict, num_stages: int, duration: Callable, gap: float = 0.0) -> tuple[float, list]:
    """The bubble of PyTorch's own order of actions (every rank's, `order_of`) with free communication: each rank
    runs its actions in order, each ``gap`` after the later of its rank's last action and what it needs, and each
    takes ``duration(stage, kind, micro-batch, split)`` (kind ``F``, ``B`` or ``W``; ``split``: a ``B`` whose
    weight gradient runs apart, as a ``W``). Returns the bubble and the events (for `plot_timeline`).

    NOTE: DualPipe-V pairs a forward with a backward; PyTorch runs the two one after the other and sends both
    results after the pair (its lowering puts the pair's sends behind it), so other ranks see them at the pair's end.
    """
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    kinds = {Kind.FORWARD: "F", Kind.BACKWARD_INPUT: "B", Kind.FULL_BACKWARD: "B", Kind.BACKWARD_WEIGHT: "W"}

    def steps(rank):  # each a tuple of (kind, stage, micro-batch): one action, or an overlapped pair
        for a in order[rank]:
            group = a.sub_actions if a is not None and a.computation_type == Kind.OVERLAP_F_B else (a,)
            if a is not None and all(x.computation_type in kinds for x in group):
                yield tuple((kinds[x.computation_type], x.stage_index, x.microbatch_index) for x in group)

    def needs(kind, s, mb):
        if kind == "F":
            return [("F", s - 1, mb)] if s > 0 else []
        if kind == "W":
            return [("B", s, mb)]
        return [("F", s, mb)] if s == num_stages - 1 else [("B", s + 1, mb)]

    pending = {rank: list(steps(rank)) for rank in order}
    split = {(s, mb) for queue in pending.values() for group in queue for kind, s, mb in group if kind == "W"}
    done, free, busy, events = {}, dict.fromkeys(order, 0.0), dict.fromkeys(order, 0.0), []
    ready = lambda action, finished: all(need in finished for need in needs(*action))
    while any(pending.values()):
        progressed = False
        for rank, queue in pending.items():
            while queue and all(ready(a, {**done, **dict.fromkeys(queue[0][:i])}) for i, a in enumerate(queue[0])):
                group = queue.pop(0)
                for action in group:
                    kind, s, mb = action
                    start = max([free[rank]] + [done[need] for need in needs(*action) if need not in group]) + gap
                    free[rank] = done[action] = end = start + duration(s, kind, mb, (s, mb) in split)
                    busy[rank] += end - start
                    events.append((s, kind, mb, start, end))
                for action in group:
                    done[action] = free[rank]
                progressed = True
        if not progressed:
            raise RuntimeError(f"the order cannot run: next actions {[q[0] for q in pending.values() if q]}")
    return 1 - statistics.mean(busy.values()) / max(free.values()), events


def nominal(forward: float, input_grad: float, weight_grad: float) -> Callable:
    """Durations from costs per chunk, as PyTorch runs the actions: a backward that is not split takes both
    gradients; the first stage (its input needs no gradient) runs an empty input-gradient action and the whole
    backward as its weight gradient."""

    def duration(stage: int, kind: str, mb: int, split: bool) -> float:
        if kind == "F":
            return forward
        if not split:
            return input_grad + weight_grad
        if stage == 0:
            return 0.0 if kind == "B" else input_grad + weight_grad
        return input_grad if kind == "B" else weight_grad

    return duration


def measured(events: list[tuple[int, str, int, float, float]], p: int, placement: str) -> tuple[Callable, float]:
    """Each action's duration as measured, and the median pause between one action and the next on a rank: the
    runtime's own time per action (Python, posting the point-to-point sends and receives)."""
    from lit3d.parallel.stages import stage_rank

    took = {(s, kind, mb): end - start for s, kind, mb, start, end in events}
    pauses = []
    for rank in range(p):
        mine = sorted((e for e in events if stage_rank(e[0], p, placement) == rank), key=lambda e: e[3])
        pauses += [max(0.0, b[3] - a[4]) for a, b in zip(mine, mine[1:])]
    return (lambda s, kind, mb, split: took[s, kind, mb]), statistics.median(pauses)
