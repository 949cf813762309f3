"""`GlobalBatchData`: what lit3d's data modules share — global batches dealt out to the data-parallel replicas, the
same in every layout, the data position saved in checkpoints so that a run resumes exactly, in any layout, and the
tokenizer, by default the one the model's pretrained weights came with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lit3d.data.sampler import GlobalBatchSampler
from lit3d.hf.pretrained import is_hf_folder, tokenizer_of

AUTO = "auto"  # a data module's tokenizer: the model's (`model_tokenizer`)


class GlobalBatchData(L.LightningDataModule):
    """A data module whose training set is read in global batches of ``global_batch_size`` samples (a seeded
    shuffle per epoch, `GlobalBatchSampler`), each replica taking its share in micro-batches.

    A subclass sets ``train_set``, ``val_set`` and ``test_set`` (map-style datasets) in ``setup``, and may deal the
    samples with its own sampler (`_sampler`). One that tokenizes passes its ``tokenizer`` argument on and loads it in
    `_load_tokenizer`, when `resolve_tokenizer` knows which.
    """

    def __init__(self, global_batch_size: int, seed: int, num_workers: int, tokenizer: str | None = None) -> None:
        super().__init__()
        self.global_batch_size, self.seed, self.num_workers = global_batch_size, seed, num_workers
        self.requested_tokenizer = tokenizer
        self.tokenizer_name: str | None = None  # the tokenizer in use, once known (`resolve_tokenizer`)
        self._tokenizer_model: int | None = None  # id() of the model an "auto" tokenizer was chosen for
        self.train_set: Any = None
        self.val_set: Any = None
        self.test_set: Any = None
        self.data_parallel: tuple[int, int] | None = None  # (size, rank); None: read from the trainer
        # Samples of each global batch per replica (`data_parallel_shares`); None: read from the trainer's strategy
        self.data_parallel_shares: tuple[int, ...] | None = None
        self._resume: dict[str, Any] | None = None  # the data position a checkpoint restored

    def resolve_tokenizer(self, module: Any = None) -> str | None:
        """The tokenizer this data is tokenized with, loaded once (`_load_tokenizer`): the ``tokenizer`` given, or for
        ``"auto"`` the one ``module``'s pretrained weights came with (`model_tokenizer`), said on rank 0.

        ``module`` is by default the model of the trainer this data is attached to, which knows it when it runs;
        ``lit3d fit`` and `Parallel3DStrategy`'s launcher pass it before any rank starts. Without a model, ``"auto"``
        is ``"byte"``; a model that comes later with another tokenizer is refused: the data was tokenized already.
        None: this data module has no tokenizer.
        """
        if self.requested_tokenizer is None:
            return None
        if self.requested_tokenizer != AUTO:
            if self.tokenizer_name is None:
                self._load_tokenizer(self.requested_tokenizer)
                self.tokenizer_name = self.requested_tokenizer
            return self.tokenizer_name
        module = module if module is not None else getattr(self.trainer, "lightning_module", None)
        if self.tokenizer_name is not None and (module is None or id(module) == self._tokenizer_model):
            return self.tokenizer_name
        found, origin = model_tokenizer(module)
        name = found or "byte"
        if self.tokenizer_name is not None and name != self.tokenizer_name:
            raise ValueError(
                f"this data was tokenized with {self.tokenizer_name!r} (tokenizer='auto', before the model was known), "
                f"but the model's is {name!r} ({origin}): give the data module tokenizer={name!r}"
            )
        if self.tokenizer_name is None:
            if getattr(module, "pretrained", None) is not None:  # (else bytes, as for every model trained from scratch)
                say = rank_zero_info if found is not None else rank_zero_warn  # weights with no tokenizer: bytes?
                say(f"tokenizer: {name!r}, {origin} (tokenizer='auto'; set the data module's tokenizer to choose)")
            self._load_tokenizer(name)
            self.tokenizer_name = name
            self.hparams["tokenizer"] = name  # what checkpoints record (`lit3d export`, `generate`)
        self._tokenizer_model = id(module) if module is not None else None
        return name

    def _load_tokenizer(self, name: str) -> None:
        """Load the tokenizer ``name`` (``"byte"``, a ``tokenizer.json`` or its folder), and what needs it."""

    def train_dataloader(self) -> DataLoader:
        loader = self._loader(self.train_set, shuffle=True)
        if self._resume is not None:
            loader.sampler.resume_at(self._resume["epoch"], self._resume["consumed_samples"])
            self._resume = None
        trainer = self.trainer
        if (
            trainer is not None
            and isinstance(trainer.val_check_interval, int)
            and trainer.val_check_interval > len(loader)
        ):
            rank_zero_warn(
                f"val_check_interval={trainer.val_check_interval} is more than the {len(loader)} batches an epoch of "
                f"this corpus has: validating every {len(loader)} batches instead"
            )
            trainer.val_check_interval = len(loader)
        return loader

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        if self.test_set is None:
            raise ValueError("test_fraction=0: this data has no test split; set test_fraction to hold one out")
        return self._loader(self.test_set, shuffle=False)

    def state_dict(self) -> dict[str, Any]:
        """The data position, saved in checkpoints: the epoch, and the samples of it consumed by all replicas
        together (not per replica, so a run can resume with another data-parallel size)."""
        trainer = self.trainer
        if trainer is None:
            return {}
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # this replica's, this epoch
        consumed = batches * self.global_batch_size // trainer.accumulate_grad_batches  # (every replica's together)
        if consumed >= len(self.train_set) - len(self.train_set) % self.global_batch_size:  # saved at an epoch end
            return {"epoch": trainer.current_epoch + 1, "consumed_samples": 0}
        return {"epoch": trainer.current_epoch, "consumed_samples": consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = dict(state) if state else None

    def micro_batch_size(self, training: bool = False) -> int:
        """Sequences per forward pass on one replica; ``training`` with `data_parallel_shares`: this replica's share
        of each global batch over its micro-steps (evaluation deals even rounds)."""
        replicas, rank = self._replica()
        accumulate = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        shares = self._shares() if training else None
        if shares is not None:
            return shares[rank] // accumulate
        if self.global_batch_size % (replicas * accumulate):
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by data_parallel_size={replicas} "
                f"x accumulate_grad_batches={accumulate}"
            )
        return self.global_batch_size // (replicas * accumulate)

    def check_sizes(self, stage: str, accumulate: int = 1, validates: bool = True) -> None:
        """Refuse, before any rank starts, data too small for this run, every shortfall in one message (a user who
        fixes one should not meet the next only then): a training split already made (a chat data set splits when it
        tokenizes) smaller than one global batch, for ``fit``; and, where the run ``validates``, a held-out set smaller
        than one round of micro-batches, one per replica (``global_batch_size / accumulate`` rows in every layout).
        ``stage``: ``fit`` and ``validate`` read the validation set, ``test`` the test set."""
        shortfalls = [self.training_shortfall()] if stage == "fit" else []
        held_out = self.test_set if stage == "test" else self.val_set
        per_round = self.global_batch_size // max(1, accumulate)
        if validates and held_out is not None and len(held_out) < per_round:
            which = "test" if stage == "test" else "validation"
            of = f" of {self.data_path!r}" if isinstance(getattr(self, "data_path", None), str) else ""
            shortfalls.append(
                f"the {which} set{of} holds {len(held_out)} sequences, fewer than one micro-batch per replica: "
                f"global_batch_size={self.global_batch_size} / accumulate_grad_batches={accumulate} = {per_round} in "
                "every layout; hold out more (val_fraction, test_fraction) or lower global_batch_size"
            )
        shortfalls = [s for s in shortfalls if s is not None]
        if shortfalls:
            raise ValueError("; and ".join(shortfalls))

    def training_shortfall(self) -> str | None:
        """Why the training split, where it is already made, cannot fill one global batch; None if it can (or is not
        made yet: a text corpus splits in ``setup``, which says so itself)."""
        return None

    def _replica(self) -> tuple[int, int]:
        """(number of data-parallel replicas, this replica's index), from the strategy: never the world size."""
        if self.data_parallel is not None:
            return self.data_parallel
        kwargs = (self.trainer.distributed_sampler_kwargs if self.trainer is not None else None) or {}
        return kwargs.get("num_replicas", 1), kwargs.get("rank", 0)

    def _shares(self) -> tuple[int, ...] | None:
        """`data_parallel_shares`: set here, or the trainer's strategy's (`lit3d.parallel.Parallelism`)."""
        if self.data_parallel_shares is not None:
            return tuple(self.data_parallel_shares)
        parallelism = getattr(getattr(self.trainer, "strategy", None), "parallelism", None)
        return getattr(parallelism, "data_parallel_shares", None)

    def _sampler(
        self, dataset: Any, per_step: int, replicas: int, rank: int, shuffle: bool, shares: Any = None
    ) -> GlobalBatchSampler:
        return GlobalBatchSampler(dataset, per_step, replicas, rank, shuffle=shuffle, seed=self.seed, shares=shares)

    def _loader(self, dataset: Any, shuffle: bool) -> DataLoader:
        replicas, rank = self._replica()
        micro = self.micro_batch_size(training=shuffle)
        # Validation deals out whole rounds of one micro-batch per replica, so every layout sees the same blocks.
        per_step = self.global_batch_size if shuffle else micro * replicas
        if not shuffle and len(dataset) < per_step:
            raise ValueError(
                f"the held-out set has {len(dataset)} sequences, fewer than one micro-batch per replica ({micro} x "
                f"{replicas}): hold out more (val_fraction, test_fraction) or lower global_batch_size"
            )
        sampler = self._sampler(dataset, per_step, replicas, rank, shuffle, self._shares() if shuffle else None)
        loader = ResumableLoader if shuffle else DataLoader  # training's position is restored; evaluation starts over
        return loader(dataset, batch_size=micro, sampler=sampler, drop_last=True, num_workers=self.num_workers)


def model_tokenizer(module: Any) -> tuple[str | None, str]:
    """The tokenizer a model's weights came with (None: none known), and where it was looked for: the
    ``tokenizer.json`` of its ``pretrained`` HuggingFace folder (`lit3d.GPT(pretrained=...)`), or the tokenizer of the
    run that wrote its ``pretrained`` lit3d checkpoint."""
    pretrained = getattr(module, "pretrained", None) if module is not None else None
    if module is None:
        return None, "no model known yet"
    if not isinstance(pretrained, str | Path):
        return None, "as the model has no pretrained weights"
    found = tokenizer_of(pretrained)
    if found is not None:
        kind = "folder" if is_hf_folder(pretrained) else "checkpoint's run"
        return found, f"the tokenizer of the model's pretrained {kind} {str(pretrained)!r}"
    where = "has no tokenizer.json" if is_hf_folder(pretrained) else "does not record its tokenizer"
    return None, f"as the model's pretrained {str(pretrained)!r} {where}"


class ResumableLoader(DataLoader):
    """The training DataLoader of lit3d's data modules, which resumes exactly: the data module saves the position in
    every checkpoint (`GlobalBatchData.state_dict`) and starts the sampler or the stream there.

    NOTE: Lightning asks the loader itself whether it resumes (``state_dict`` and ``load_state_dict``), and warns on
    every mid-epoch resume when it does not; the position has one owner, the data module, so the loader says yes
    with nothing of its own to save.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load: the data module has restored the position before the loader was made."""
