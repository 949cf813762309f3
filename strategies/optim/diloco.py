"""DiLoCo across islands (Douillard et al., 2023): islands train on their own and meet every ``sync_every`` steps.

Each island is a whole ``dp × tp × pp`` layout (with ZeRO) that syncs every inner step inside itself, over its own
fast links. Every ``sync_every`` inner steps the outer step runs, the only traffic between islands::

    pseudo-gradient  Δ = anchor − weights          (per island: what its inner steps changed since the last sync)
    average          Δ = mean of Δ over islands     (one all-reduce over the ``island`` mesh dim)
    outer step       anchor ← SGD(anchor, Δ; outer_lr, Nesterov momentum outer_momentum)
    weights          ← anchor                        (every island starts the next round from the same weights)

The anchor is an fp32 copy of exactly what this rank's inner optimizer steps: its ZeRO-1 slices (before they are
all-gathered, so only a slice crosses the island link and the all-gather spreads the result inside the island),
its FSDP2 shards (ZeRO-2/3) or its tensor-parallel shards, on its pipeline stage. The ranks with the same
``(d, c, t, p)`` in every island hold the same slices, so the averages are per slice: no gather crosses islands.

With ``outer_lr=1`` and no momentum one round is the average of the islands' inner steps; with one island and
those settings, it is synchronous data parallelism. Streaming DiLoCo (Douillard et al., 2025): with
``fragments > 1`` the tensors are cut into that many fragments of about equal size, fragment ``f`` synced at the
inner steps ``(f + 1)·H/F (mod H)``: the same bytes per ``H`` steps, ``1/F`` of them at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from lit3d.parallel.settings import Parallelism
    from lit3d.strategies.meshes import ParallelMeshes

from lit3d.checkpoint.folder import parameter_names
from lit3d.parallel.outer import OUTER_REDUCE_DTYPE_NAMES

OUTER_REDUCE_DTYPES = dict(zip(OUTER_REDUCE_DTYPE_NAMES, (torch.float32, torch.bfloat16)))


class OuterLoop:
    """DiLoCo's outer optimizer over the tensors this rank's inner optimizer steps.

    Args:
        tensors: Each a function that returns the live local tensor (the inner optimizer updates it in place).
        names: The parameter name of each (checkpoints key the anchor and momentum by it).
        as_global: Each a function that places a tensor shaped like the local one in the parameter's global shape
            (a DTensor sharing its storage), for layout-free checkpoints.
        group: The process group over the islands (ranks with the same coordinate in each); None for one island.
        islands, sync_every, lr, momentum, fragments, reduce_dtype: See `Parallel3DStrategy`.
    """

    def __init__(
        self,
        tensors: list[Callable[[], torch.Tensor]],
        names: list[str],
        as_global: list[Callable[[torch.Tensor], torch.Tensor]],
        group: Any,
        islands: int,
        sync_every: int,
        lr: float,
        momentum: float,
        fragments: int = 1,
        reduce_dtype: str = "float32",
    ) -> None:
        if len(tensors) < fragments:
            raise ValueError(f"outer_fragments={fragments} is more than the {len(tensors)} tensors this rank holds")
        self.tensors, self.names, self.as_global, self.group = tensors, names, as_global, group
        self.islands, self.sync_every, self.reduce_dtype = islands, sync_every, OUTER_REDUCE_DTYPES[reduce_dtype]
        with torch.no_grad():
            self.anchor = [get().detach().float().clone() for get in tensors]
        # NOTE: torch's SGD with nesterov=True is DiLoCo's outer Nesterov: buf = m·buf + Δ; anchor -= lr·(Δ + m·buf).
        self.optimizer = torch.optim.SGD(self.anchor, lr=lr, momentum=momentum, nesterov=momentum > 0)
        if momentum > 0:  # created now (zero: the same first step as SGD's lazy one), so a checkpoint loads in place
            for anchor in self.anchor:
                self.optimizer.state[anchor]["momentum_buffer"] = torch.zeros_like(anchor)
        self.inner_steps = torch.zeros((), dtype=torch.int64)  # since the start of training (a checkpointed tensor)
        self.fragments = _split([a.numel() for a in self.anchor], fragments)
        self.syncs = 0  # outer steps taken in this process (for reports and tests)

    def due(self, inner_step: int) -> list[int]:
        """The fragments whose outer step falls after inner step ``inner_step`` (counted from 1)."""
        n, h = len(self.fragments), self.sync_every
        return [f for f in range(n) if inner_step % h == (f + 1) * h // n % h]

    def starts_round(self) -> bool:
        """Whether the next inner step is the first of a round (every island holds the anchor's weights then)."""
        return int(self.inner_steps) % self.sync_every == 0

    @torch.no_grad()
    def after_inner_step(self, across: Any = None) -> None:
        """Count an inner optimizer step; run the outer step of every fragment that is due. ``across``: the replica
        groups (`lit3d.strategies.runtime.replica_groups.ReplicaGroups`) whose islands average the pseudo-gradients,
        or None: the islands of this world (``self.group``)."""
        self.inner_steps += 1
        for fragment in self.due(int(self.inner_steps)):
            self.sync(fragment, across)

    @torch.no_grad()
    def sync(self, fragment: int = 0, across: Any = None) -> None:
        """The outer step of one fragment: average the pseudo-gradients over the islands, step, copy back."""
        chosen = self.fragments[fragment]
        anchors = [self.anchor[i] for i in chosen]
        live = [self.tensors[i]() for i in chosen]

        def pseudo_gradient() -> torch.Tensor:
            return torch.cat([(a - w.float()).reshape(-1) for a, w in zip(anchors, live)]).to(self.reduce_dtype)

        if across is not None:  # over the groups that take part (their number: torchft's quorum's); None: another
            averaged = across.average_outer(pseudo_gradient)  # group's outer step, loaded whole (none of its own)
        else:
            flat = pseudo_gradient()
            if self.islands > 1:  # one collective per fragment over the slow link
                dist.all_reduce(flat, group=self.group)
            averaged = flat.float().div_(self.islands)
        if averaged is not None:
            for anchor, delta in zip(anchors, averaged.float().split([a.numel() for a in anchors])):
                anchor.grad = delta.view_as(anchor)
            self.optimizer.step()  # steps only the anchors that have a gradient: this fragment's
        for anchor, weights in zip(anchors, live):
            anchor.grad = None
            weights.copy_(anchor)
        self.syncs += 1

    def state_tensors(self) -> list[torch.Tensor]:
        """What the outer loop holds throughout training: the anchor and the momentum buffers."""
        return [*self.anchor, *self._momentum_buffers()]

    def _momentum_buffers(self) -> list[torch.Tensor]:
        """The outer SGD's momentum buffer of each anchor (none without momentum)."""
        if self.optimizer.defaults["momentum"] == 0:
            return []
        return [self.optimizer.state[a]["momentum_buffer"] for a in self.anchor]

    def state_by_name(self) -> dict[str, Any]:
        """Anchor, momentum and the inner step count, keyed by parameter name and placed in the global tensors
        (sharing storage: loading into the returned dict in place loads the outer loop)."""
        state: dict[str, Any] = {
            "anchor": {name: glob(a) for name, glob, a in zip(self.names, self.as_global, self.anchor)},
            "inner_steps": self.inner_steps,
        }
        if buffers := self._momentum_buffers():
            state["momentum"] = {name: glob(b) for name, glob, b in zip(self.names, self.as_global, buffers)}
        return state


def _split(sizes: list[int], parts: int) -> list[list[int]]:
    """Consecutive indices of ``sizes`` in ``parts`` groups of about equal sum, none empty."""
    total, groups, current, done = sum(sizes), [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        done += size
        left = len(sizes) - i - 1
        if len(groups) < parts - 1 and (done >= total * (len(groups) + 1) / parts or left == parts - len(groups) - 1):
            groups.append(current)
            current = []
    return [*groups, current] if current else groups


def build_outer_loop(
    parallelism: Parallelism,
    meshes: ParallelMeshes,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    local_optimizers: dict[int, Any],
) -> OuterLoop:
    """The outer loop over what the run's (single) inner optimizer steps on this rank (``local_optimizers``: the
    ones that step on local shards, by id of the optimizer)."""

    if len(optimizers) != 1:
        raise ValueError(
            f"islands={parallelism.islands}, sync_every={parallelism.sync_every}: DiLoCo needs exactly one optimizer, "
            f"the module configured {len(optimizers)}"
        )
    optimizer = optimizers[0]
    names = parameter_names(module)
    local = local_optimizers.get(id(optimizer))
    tensors, keys, globals_ = [], [], []
    if local is not None:  # ZeRO-1 slices or tensor-parallel shards: the optimizer's own views
        for entry in local.entries:
            if not entry.view.requires_grad:
                continue
            tensors.append(lambda view=entry.view: view)
            keys.append(names[id(entry.param)])
            globals_.append(lambda state, view=entry.view: local.as_global(view, state))
    else:
        for param in (p for group in optimizer.param_groups for p in group["params"] if p.requires_grad):
            tensors.append(lambda p=param: p.to_local() if isinstance(p, DTensor) else p)
            keys.append(names[id(param)])
            globals_.append(lambda state, p=param: _like(p, state))
    p = parallelism
    return OuterLoop(
        tensors,
        keys,
        globals_,
        meshes.group("island"),
        meshes.layout.islands,
        p.sync_every,
        p.outer_lr,
        p.outer_momentum,
        p.outer_fragments,
        p.outer_reduce_dtype,
    )


def _like(param: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """``state`` (shaped like ``param``'s local tensor) placed as ``param`` is: a DTensor for a sharded one."""
    if not isinstance(param, DTensor):
        return state
    return DTensor.from_local(
        state, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
