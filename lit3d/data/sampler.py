"""The sampler that makes global batch k the same set of samples in every parallel layout."""

from __future__ import annotations

from collections.abc import Iterator, Sized

import numpy as np
import torch
from torch.utils.data import DistributedSampler


class GlobalBatchSampler(DistributedSampler):
    """Deals each global batch out to the data-parallel replicas.

    One epoch is a seeded permutation of the dataset cut to whole global batches. Replica ``r`` of ``R`` takes
    every R-th index starting at ``r``, so its k-th group of ``global_batch_size / R`` indices comes from
    positions ``[k·G, (k+1)·G)`` of the permutation: global batch k holds the same samples whatever R is (and
    however each replica's share is split into micro-batches).

    With ``shares`` (`data_parallel_shares`: samples per replica, summing to the global batch) replica ``r`` takes its
    own run of ``shares[r]`` positions of each global batch instead: still the same global batch.

    It is a `DistributedSampler`, so Lightning keeps it instead of injecting its own, and calls
    `set_epoch` on it. `resume_at` starts one epoch part-way through, for resuming a run: the position counts
    global samples, so it does not depend on R either (a run may resume with another number of replicas).
    """

    def __init__(
        self,
        dataset: Sized,
        global_batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        shares: tuple[int, ...] | None = None,
    ) -> None:
        if shares is None and global_batch_size % num_replicas:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by the data-parallel size {num_replicas}"
            )
        if len(dataset) < global_batch_size:
            raise ValueError(
                f"the dataset has {len(dataset)} samples, fewer than one global batch ({global_batch_size})"
            )
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.global_batch_size, self.shares = global_batch_size, shares
        self._resume: tuple[int, int] | None = None  # (epoch, global samples already consumed in it)

    def resume_at(self, epoch: int, consumed_samples: int) -> None:
        """The next iteration of ``epoch`` skips its first ``consumed_samples`` (rounded down to whole global
        batches); later epochs start from their beginning again."""
        self.set_epoch(epoch)
        self._resume = (epoch, consumed_samples - consumed_samples % self.global_batch_size)

    @property
    def samples_per_epoch(self) -> int:
        """Global samples in one epoch: whole global batches only."""
        return len(self.dataset) - len(self.dataset) % self.global_batch_size

    def epoch_order(self) -> torch.Tensor:
        """The order of all samples of the current epoch, before dealing out to replicas."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator)
        else:
            order = torch.arange(len(self.dataset))
        return order[: self.samples_per_epoch]

    def remaining_order(self) -> torch.Tensor:
        """`epoch_order` from where this iteration starts (after what a resumed run already consumed)."""
        skip = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            skip, self._resume = self._resume[1], None
        return self.epoch_order()[skip:]

    def __iter__(self) -> Iterator[int]:
        # NOTE: one int at a time from the int64 order, not a list of Python ints (~36 bytes each): memory must not
        # grow with the corpus's block count.
        order = self.remaining_order()
        if self.shares is None:
            return map(int, order[self.rank :: self.num_replicas].numpy())
        return (
            int(i)
            for start in range(0, len(order), self.global_batch_size)
            for i in self.mine(order[start : start + self.global_batch_size]).numpy()
        )

    def mine(self, batch: torch.Tensor) -> torch.Tensor:
        """This replica's samples of one global ``batch``: every R-th, or its run of ``shares``."""
        if self.shares is None:
            return batch[self.rank :: self.num_replicas]
        start = sum(self.shares[: self.rank])
        return batch[start : start + self.shares[self.rank]]

    def __len__(self) -> int:
        # NOTE: the whole epoch, also when resuming part-way: Lightning counts the batches it already ran.
        if self.shares is None:
            return self.samples_per_epoch // self.num_replicas
        return self.samples_per_epoch // self.global_batch_size * self.shares[self.rank]


class TrainedTokenSampler(GlobalBatchSampler):
    """`GlobalBatchSampler` for data whose loss is taken on some targets only (chat data: the answers). Each index
    comes with its global batch's ``loss_scale``: the batch's targets over its trained targets, ``trained[i]`` being
    sample ``i``'s and ``targets_per_sample`` every sample's (see `lit3d.GPT.loss`), 0 for a batch without any.
    Every replica computes it from the whole global batch, so no rank has to ask the others.
    """

    def __init__(self, dataset: Sized, trained: np.ndarray, targets_per_sample: int, *args, **kwargs) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.trained, self.targets_per_sample = torch.as_tensor(trained, dtype=torch.int64), targets_per_sample

    def __iter__(self) -> Iterator[tuple[int, float]]:
        order, size = self.remaining_order(), self.global_batch_size
        for start in range(0, len(order), size):
            batch = order[start : start + size]
            trained = int(self.trained[batch].sum())
            scale = size * self.targets_per_sample / trained if trained else 0.0
            for index in self.mine(batch).tolist():
                yield index, scale
