"""A mixture of block datasets (packed `datasets`, prepared folders, or both), drawn by weight."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class MixtureBlocks(torch.utils.data.Dataset):
    """Block ``i`` comes from a source drawn by weight (a seeded draw, so every layout sees the same mixture),
    each source's blocks in their order. The mixture ends where the first source runs out, so no block repeats
    and the shares are the weights.

    Memory: 9 bytes per block (the source of each and its index there), not the blocks themselves.
    """

    def __init__(self, parts: list[Any], weights: list[float], seed: int, chunk: int = 2**16) -> None:
        self.parts = parts
        rng, used, draws = np.random.default_rng(seed), np.zeros(len(parts), np.int64), []
        while True:
            draw = rng.choice(len(parts), size=chunk, p=weights).astype(np.uint8)
            end = chunk
            for source, part in enumerate(parts):  # where this source would run out
                picks = np.flatnonzero(draw == source)
                if len(picks) > len(part) - used[source]:
                    end = min(end, int(picks[len(part) - used[source]]))
            draws.append(draw[:end])
            used += np.bincount(draw[:end], minlength=len(parts))
            if end < chunk:
                break
        self.source = np.concatenate(draws)
        self.index = np.zeros(len(self.source), np.int64)
        for source in range(len(parts)):  # the k-th draw of a source reads its k-th block
            picks = self.source == source
            self.index[picks] = np.arange(int(picks.sum()))

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        block = self.parts[int(self.source[i])][int(self.index[i])]["input_ids"]
        return {"input_ids": torch.as_tensor(block, dtype=torch.long)}
