"""The chunk modules themselves: a network's pipeline chunks as views of it, and the pruning of what a rank does
not run. Where the cut falls (which blocks each chunk runs, on which rank) is `lit3d.parallel.stages`.

The network's ``blocks`` (a ModuleDict of decoder blocks, in order) are cut into chunks; its other top-level parts
go with the ends: those registered before ``blocks`` (an embedding) run on the first chunk, those after it (final
norm, head) on the last. The network's ``forward`` must pass through a part that is ``None``: that is how a chunk
skips what it lacks.

A chunk is a *view* of the network: a module of the network's class with every attribute of the network, the
same block objects under the same keys, and the parts it does not run set to ``None``. Parameter names never
change, so checkpoints do not care which layout wrote them.
"""

from __future__ import annotations

import torch.nn as nn

from lit3d.parallel.stages import chunk_stage_ids, stage_runs


def end_parts(network: nn.Module) -> tuple[list[str], list[str]]:
    """Names of the network's top-level parts that run before ``blocks`` (first chunk) and after it (last)."""
    names = list(network._modules)
    if not isinstance(network._modules.get("blocks"), nn.ModuleDict):
        raise TypeError(f"pipeline parallelism cuts a network's `blocks` ModuleDict; {type(network).__name__} has none")
    i = names.index("blocks")
    return names[:i], names[i + 1 :]


def block_costs(network: nn.Module) -> tuple[list[float], float, float]:
    """Parameter elements of each block, of the parts before the blocks and of those after them."""

    def numel(module: nn.Module | None) -> float:
        return float(sum(p.numel() for p in module.parameters())) if module is not None else 0.0

    before, after = end_parts(network)
    costs = [numel(block) for block in network.blocks.values()]
    return costs, sum(numel(network._modules[n]) for n in before), sum(numel(network._modules[n]) for n in after)


def stage_view(network: nn.Module, block_keys: list[str], first: bool, last: bool) -> nn.Module:
    """A module running part of ``network``: its blocks ``block_keys``, the parts before the blocks when
    ``first``, those after them when ``last``. Every other attribute is the network's; nothing is copied.

    NOTE: a fresh module (not `copy.copy`) so that hooks later registered on a chunk (FSDP's, the pipeline
    clock's) stay on that chunk.
    """
    view = type(network).__new__(type(network))
    nn.Module.__init__(view)
    for key, value in vars(network).items():
        if key not in vars(view):  # plain attributes: the config, flags, anything a subclass adds
            view.__dict__[key] = value
    view._parameters.update(network._parameters)
    view._buffers.update(network._buffers)
    view._non_persistent_buffers_set.update(network._non_persistent_buffers_set)
    before, _ = end_parts(network)
    for name, part in network._modules.items():
        if name == "blocks":
            part = nn.ModuleDict({key: network.blocks[key] for key in block_keys})
        elif not (first if name in before else last):
            part = None
        view._modules[name] = part
    return view


def prune(network: nn.Module, keep_blocks: set[str], keep_first: bool, keep_last: bool) -> None:
    """Drop, in place, every part of ``network`` this rank does not run (names of the rest are unchanged)."""
    before, after = end_parts(network)
    for key in [k for k in network.blocks if k not in keep_blocks]:
        del network.blocks[key]
    for name in (before if not keep_first else []) + (after if not keep_last else []):
        setattr(network, name, None)


def split_into_stages(
    network: nn.Module, rank: int, pp: int, virtual: int, placement: str = "loop", layers: tuple[int, ...] | None = None
) -> tuple[list[nn.Module], list[int]]:
    """Keep in ``network`` only what pipeline rank ``rank`` runs; return its chunk views and stage indices.
    ``layers``: the blocks of each stage (`pipeline_stage_layers`), else cut by cost."""
    num_stages = pp * virtual
    runs = stage_runs(*block_costs(network), num_stages, layers)
    keys = list(network.blocks)
    stage_ids = chunk_stage_ids(rank, pp, virtual, placement)
    mine = {s: [keys[b] for b in runs[s]] for s in stage_ids}
    prune(network, {key for ids in mine.values() for key in ids}, 0 in stage_ids, num_stages - 1 in stage_ids)
    chunks = [stage_view(network, mine[s], first=s == 0, last=s == num_stages - 1) for s in stage_ids]
    return chunks, stage_ids
