"""`TextDataModule`: text files → tokens → packed ``seq_len + 1`` blocks, built on HuggingFace `datasets`."""

from __future__ import annotations

import functools
import hashlib
import json
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from lit3d.data.batches import AUTO, GlobalBatchData, ResumableLoader
from lit3d.data.chat import ChatDataModule  # noqa: F401 (re-exported: `lit3d.data.ChatDataModule`)
from lit3d.data.mixture import MixtureBlocks
from lit3d.data.prepared import PreparedBlocks, is_prepared, read_index
from lit3d.data.sources import check_source, load_documents, resolve_files
from lit3d.data.streaming import StreamedBlocks, held_out
from lit3d.data.tokenizers import Tokenizer, load_tokenizer, tokenize_documents
from lit3d.models.documents import document_starts, row_positions


def default_corpus() -> str:
    """The embedded default corpus, as a glob: the Python standard library's own top-level source files."""
    return str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")


def default_corpus_files() -> list[str]:
    return resolve_files(default_corpus())


class TextDataModule(GlobalBatchData):
    """Packed language-modelling blocks from local text.

    Every document is tokenized (a cached, batched `datasets.map`), the token stream is cut into blocks of
    ``seq_len + 1`` (inputs and their next-token targets), and the blocks are split into training and
    validation sets by a seeded shuffle. Global batch k holds the same blocks whatever the data-parallel size.

    Args:
        data_path: A file, a folder (every file below it) or a glob, each file read by its format (text files,
            ``.json``/``.jsonl`` (``.gz``, ``.zst``), ``.parquet``, ``.csv``, ``.arrow``; see `lit3d.data.sources`); a
            folder written by `datasets.Dataset.save_to_disk`; ``hf:NAME``, a HuggingFace dataset (hub or local
            folder) with ``name`` and ``split``; or a mixture ``{source: weight, ...}`` whose blocks are drawn in
            proportion to the weights. ``None`` uses the embedded default corpus: the Python standard library's
            own source files, present on every machine. A folder written by ``lit3d prepare`` is read
            memory-mapped, block by block; it may be part of a mixture.
        tokenizer: ``"byte"`` (256 ids, no files), a HuggingFace ``tokenizer.json`` or the folder holding it, or
            ``"auto"``: the tokenizer the model's pretrained weights came with (`GPT(pretrained=...)`: its folder's
            ``tokenizer.json``, or its checkpoint's run's tokenizer), else ``"byte"``
            (`lit3d.data.batches.GlobalBatchData.resolve_tokenizer`).
        seq_len: Tokens per training sequence.
        global_batch_size: Sequences per optimizer step across all data-parallel replicas. Each replica's
            micro-batch is ``global_batch_size / (data_parallel_size * accumulate_grad_batches)``.
        val_fraction: Share of the blocks held out for validation (at least one block); with ``streaming``, of
            the blocks of the stream's first shuffle window.
        test_fraction: Share of the blocks held out for ``test`` (0: no test split).
        prompts: Texts that ``predict`` (and ``lit3d generate``) continue, one per batch.
        seed: Seed of the train/validation split and of the per-epoch shuffle.
        text_column: The column holding the text in tables (json, parquet, csv, arrow) and datasets.
        name: The configuration of an ``hf:`` dataset.
        split: The split of an ``hf:`` dataset or a saved ``DatasetDict``.
        num_workers: DataLoader worker processes (at most one with ``streaming``: a stream has one reader).
        cache_dir: Where `datasets` caches the tokenized corpus (default: its own cache folder).
        streaming: Read the sources as training goes, caching nothing, for corpora too large to cache: blocks are
            shuffled within windows of about 16M tokens, the stream cycles (train by ``max_steps``), and a
            checkpoint records the exact position (see `lit3d.data.streaming`).
        document_masking: Keep the documents packed into one block apart: attention never crosses a document
            boundary and rotary positions restart at each document (`lit3d.models.documents`), as if each ran alone. For
            one cached source (not streamed, prepared or mixed).
    """

    def __init__(
        self,
        data_path: dict[str, float] | str | None = None,
        tokenizer: str = "auto",
        seq_len: int = 256,
        global_batch_size: int = 16,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        prompts: list[str] | None = None,
        seed: int = 1234,
        text_column: str = "text",
        name: str | None = None,
        split: str = "train",
        num_workers: int = 0,
        cache_dir: str | None = None,
        streaming: bool = False,
        document_masking: bool = False,
    ) -> None:
        super().__init__(global_batch_size, seed, num_workers, tokenizer)
        if seq_len <= 0 or global_batch_size <= 0:
            raise ValueError(f"seq_len={seq_len} and global_batch_size={global_batch_size} must be positive")
        if not 0 < val_fraction < 1 or not 0 <= test_fraction < 1 - val_fraction:
            raise ValueError(
                f"val_fraction={val_fraction} must lie strictly between 0 and 1, and test_fraction={test_fraction} "
                "between 0 and what validation leaves"
            )
        self.save_hyperparameters()
        self.data_path, self.seq_len = data_path, seq_len
        self.val_fraction, self.test_fraction, self.text_column = val_fraction, test_fraction, text_column
        self.prompts = list(prompts or [])
        self.name, self.split, self.cache_dir = name, split, cache_dir
        self.streaming, self.document_masking = streaming, document_masking
        self._tokenizer: Tokenizer | None = None
        self.sources = mixture_weights(data_path)  # source -> share of the blocks
        if document_masking and (streaming or len(self.sources) > 1 or any(map(is_prepared, self.sources))):
            raise ValueError(
                f"document_masking=True packs one source's documents with their positions: data_path={data_path!r} "
                f"(streaming={streaming}) is a stream, a mixture or a prepared folder"
            )
        for source in self.sources:  # NOTE: here, in the launching process, so a source no rank can read fails once
            check_source(source, text_column, split)
            if streaming and is_prepared(source):
                raise ValueError(f"{source!r} is a prepared folder, read memory-mapped: train on it without streaming")
        if streaming and num_workers > 1:
            raise ValueError(f"streaming reads one stream in order: num_workers={num_workers} must be 0 or 1")
        self.train_start: list[dict] | None = None  # streaming: each source's position where training starts
        self.stream_position: dict | None = None  # streaming: the position after the last batch trained on
        if tokenizer != AUTO:  # else when the model is known
            self.resolve_tokenizer()

    def _load_tokenizer(self, name: str) -> None:
        self._tokenizer = load_tokenizer(name)
        for source in filter(is_prepared, self.sources):  # prepared with this tokenizer, or refused
            read_index(source, self._tokenizer)

    @property
    def tokenizer(self) -> Tokenizer:
        self.resolve_tokenizer()
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def prepare_data(self) -> None:
        if self.streaming:  # nothing to cache
            return
        if self.trainer is None or self.trainer.state.fn != "predict":  # prediction reads only the prompts
            self._packed_blocks()  # tokenizes once per node; `setup` then reads the cache

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None or self.train_start is not None or stage == "predict":
            return
        if self.streaming:
            return self._hold_out_from_stream()
        blocks = self._packed_blocks()
        n_val = max(1, round(self.val_fraction * len(blocks)))
        n_test = max(1, round(self.test_fraction * len(blocks))) if self.test_fraction else 0
        if len(blocks) - n_val - n_test < self.global_batch_size:
            raise ValueError(
                f"the corpus packs into {len(blocks)} blocks of seq_len+1={self.seq_len + 1} tokens, too few for "
                f"a global batch of {self.global_batch_size} plus {n_val} validation and {n_test} test blocks; use "
                "more text or a smaller seq_len / global_batch_size"
            )
        if not hasattr(blocks, "train_test_split"):  # a seeded permutation of the block indices (nothing is read)
            order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(self.seed)).numpy()
            self.val_set = Subset(blocks, order[:n_val])
            self.test_set = Subset(blocks, order[n_val : n_val + n_test]) if n_test else None
            self.train_set = Subset(blocks, order[n_val + n_test :])
            return
        split = blocks.train_test_split(test_size=n_val, shuffle=True, seed=self.seed)
        train, self.val_set = split["train"], split["test"].with_format("torch")
        if n_test:  # from what training would have had: the validation blocks stay what they were
            split = train.train_test_split(test_size=n_test, shuffle=True, seed=self.seed + 1)
            train, self.test_set = split["train"], split["test"].with_format("torch")
        self.train_set = train.with_format("torch")

    def train_dataloader(self) -> DataLoader:
        return self._stream_loader() if self.streaming else super().train_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The ``prompts``, tokenized, one per batch (Lightning deals them out over the data-parallel replicas)."""
        if not self.prompts:
            raise ValueError("no prompts to continue: give TextDataModule(prompts=[...]) (--data.prompts)")
        ids = self.tokenizer.encode_batch(self.prompts)
        return DataLoader([{"input_ids": torch.as_tensor(np.asarray(i), dtype=torch.long)} for i in ids], batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        """The data position, saved in checkpoints (`GlobalBatchData.state_dict`; streaming: the stream's)."""
        if self.streaming:  # every rank trains on the same global batches, so its position is everyone's
            return {"stream": self.stream_position} if self.stream_position is not None else {}
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if bool(state.get("stream")) != self.streaming and state:
            raise ValueError(
                f"the checkpoint's data position was recorded with streaming={not self.streaming}; resume it with "
                f"the same data.streaming, not streaming={self.streaming}"
            )
        super().load_state_dict(state)
        self.stream_position = state.get("stream")  # saved again as it is until a batch moves it on

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Streaming: remember the position the batch training is about to consume leaves the stream at."""
        if isinstance(batch, dict) and "stream" in batch:
            self.stream_position = json.loads(batch.pop("stream")[-1])
        return batch

    def _packed_blocks(self) -> Any:
        """The sources' documents tokenized and packed into blocks (a prepared folder's read memory-mapped); a
        mixture's blocks drawn by weight."""
        packed = [
            PreparedBlocks(source, self.seq_len + 1, self.tokenizer) if is_prepared(source) else self._packed(source)
            for source in self.sources
        ]
        if len(packed) == 1:
            return packed[0]
        return MixtureBlocks(
            [p if isinstance(p, PreparedBlocks) else p.with_format("numpy") for p in packed],
            list(self.sources.values()),
            seed=self.seed,
        )

    def _open_documents(self) -> Any:
        return functools.partial(
            load_documents,
            text_column=self.text_column,
            name=self.name,
            split=self.split,
            cache_dir=self.cache_dir,
            streaming=True,
        )

    def _hold_out_from_stream(self) -> None:
        """Streaming: validation and test blocks from the start of the stream; training starts after them."""
        val, test, self.train_start = held_out(
            self._open_documents(),
            self.sources,
            self.tokenizer,
            self.seq_len + 1,
            self.global_batch_size,
            self.seed,
            (self.val_fraction, self.test_fraction),
        )
        self.val_set = [{"input_ids": torch.from_numpy(b.astype(np.int64))} for b in val]
        self.test_set = [{"input_ids": torch.from_numpy(b.astype(np.int64))} for b in test] or None

    def _stream_loader(self) -> DataLoader:
        replicas, rank = self._replica()
        if self._shares() is not None:
            raise ValueError(
                f"data_parallel_shares={list(self._shares())} with a streamed corpus: a stream deals "
                "even shares; prepare it (lit3d prepare) or read it as a dataset"
            )
        resume = self._resume.get("stream") if self._resume else None
        self._resume = None
        blocks = StreamedBlocks(
            self._open_documents(),
            self.sources,
            self.tokenizer,
            self.seq_len + 1,
            self.global_batch_size,
            replicas,
            rank,
            self.seed,
            self.train_start,
            resume,
        )
        return ResumableLoader(blocks, batch_size=self.micro_batch_size(), num_workers=self.num_workers)

    def _packed(self, source: str) -> Any:
        import datasets

        raw = load_documents(source, self.text_column, self.name, self.split, self.cache_dir)
        key = f"{raw._fingerprint}-{self.tokenizer.fingerprint}-{self.seq_len}"
        fingerprint = hashlib.sha256(key.encode()).hexdigest()[:16]
        int32_ids = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
        columns = ["input_ids", "positions"] if self.document_masking else ["input_ids"]
        packed_features = datasets.Features({column: datasets.Sequence(datasets.Value("int32")) for column in columns})
        tokens = raw.map(
            tokenize_documents,
            batched=True,
            remove_columns=raw.column_names,
            features=int32_ids,
            fn_kwargs={"tokenizer": self.tokenizer},
            new_fingerprint=f"tok-{fingerprint}",
            desc="tokenizing",
        )
        packed = tokens.with_format("numpy").map(
            _pack,
            batched=True,
            batch_size=1000,
            features=packed_features,
            fn_kwargs={"block": self.seq_len + 1, "document_masking": self.document_masking},
            new_fingerprint=f"pack-{fingerprint}-{self.document_masking:d}",
            desc="packing",
        )
        return packed.with_format(None)


def mixture_weights(data_path: str | dict[str, float] | None) -> dict[str, float]:
    """``data_path`` as ``{source: share}`` with shares adding up to 1; refuses a weight that is not positive."""
    if data_path is None:
        return {default_corpus(): 1.0}
    if isinstance(data_path, str):
        return {data_path: 1.0}
    bad = {source: weight for source, weight in data_path.items() if not (weight > 0 and weight < float("inf"))}
    if not data_path or bad:
        raise ValueError(f"data_path mixture {data_path!r}: every source needs a positive, finite weight (bad: {bad})")
    total = sum(data_path.values())
    return {source: weight / total for source, weight in data_path.items()}


def _pack(batch: dict[str, list], block: int, document_masking: bool = False) -> dict[str, np.ndarray]:
    """Concatenate the documents of a batch and cut whole blocks (the remainder of the batch is dropped); with
    ``document_masking``, also each token's position within its document (`lit3d.models.documents`)."""
    stream = np.concatenate(batch["input_ids"]) if len(batch["input_ids"]) else np.zeros(0, np.int32)
    n = len(stream) // block
    packed = {"input_ids": stream[: n * block].reshape(n, block)}
    if document_masking:
        starts = document_starts([len(doc) for doc in batch["input_ids"]])
        packed["positions"] = row_positions(starts[: n * block].reshape(n, block))
    return packed
