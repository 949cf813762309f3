"""What the sharding axes split: the dim of a weight each tensor-parallel role splits, and the size of ZeRO-1's
collectives. The strategy applies these (`lit3d.strategies.split.tensor_parallel`,
`lit3d.strategies.optim.zero1_buckets`) and the planner counts with them."""

from __future__ import annotations

ROLES = (
    "colwise",
    "rowwise",
    "tp_region",
    "replicated_region",
    "replicated",
    "norm",
    "residual_norm",
    "head_norm",
    "head_split",
    "vocab_embedding",
    "vocab_head",
)
# The dim of its weight each role splits over the TP ranks (an ``nn.Linear`` weight is [out, in], an embedding's
# [vocab, d]); the roles not named here leave their weights whole. The planner counts shards with this.
SHARDED_DIM = {"colwise": 0, "rowwise": 1, "head_split": 0, "vocab_embedding": 0, "vocab_head": 0}

BUCKET_ELEMENTS = 50_000_000  # one ZeRO-1 collective moves at most this many elements per rank


def part_sizes(size: int, parts: int) -> list[int]:
    """``torch.chunk``'s split of ``size`` into ``parts``, which DTensor's ``Shard`` and ZeRO-1's slices follow:
    trailing parts may be smaller, or empty."""
    step = -(-size // parts)
    return [max(0, min(step, size - r * step)) for r in range(parts)]
