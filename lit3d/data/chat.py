"""`ChatDataModule`: conversations or prompt/response pairs, trained on their answers only, packed into rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit3d.data.batches import AUTO, GlobalBatchData
from lit3d.data.chat_template import ChatTemplate, conversation, read_rows
from lit3d.data.sampler import TrainedTokenSampler
from lit3d.models.documents import row_positions

OVERLONG = ("error", "truncate", "drop")


class ChatDataModule(GlobalBatchData):
    """Instruction and chat data: the loss is the mean over every answer token of the global batch.

    Each row of ``data_path`` is a conversation (a ``messages`` column of ``{"role", "content"}`` turns, roles
    ``system``, ``user``, ``assistant``, ``tool``) or a ``prompt``/``response`` pair (and optionally ``system``). It is
    rendered with the chat template of the ``tokenizer`` folder (`lit3d.data.chat_template`) and trained on the tokens
    of the assistants' answers only. Examples are packed whole into rows of ``seq_len + 1`` tokens, kept apart by
    document masking (`lit3d.models.documents`); the rest of a row is padding, never trained on.

    However the answer tokens fall over replicas, micro-batches, pipeline stages and context-parallel chunks, the
    step's loss is their global mean: every batch carries its global batch's ``loss_scale`` (`lit3d.GPT.loss`).

    Everything is read, tokenized and checked in the launching process, so that bad data is refused before any rank
    starts (a held-out set smaller than one round of the layout's micro-batches, which only the ranks know, is refused
    when its loader is made): when the data module is made, or with ``tokenizer="auto"`` when the model is known
    (``lit3d fit`` and `Parallel3DStrategy`'s launcher know it before any rank starts).

    Args:
        data_path: A ``.jsonl``, ``.json`` or ``.parquet`` file.
        tokenizer: A local HuggingFace tokenizer folder or its ``tokenizer.json`` (and a chat template beside it, in
            ``tokenizer_config.json`` or ``chat_template.jinja``); ``"auto"``: the folder of the model's pretrained
            weights (`GPT(pretrained=...)`, `lit3d.data.batches.GlobalBatchData.resolve_tokenizer`).
        seq_len: Tokens per training row.
        global_batch_size: Rows per optimizer step across all data-parallel replicas.
        val_fraction: Share of the examples held out for validation (at least one).
        test_fraction: Share of the examples held out for ``test`` (0: none).
        seed: Seed of the split and of the per-epoch shuffle.
        packing: Pack several examples into a row; ``False``: one example per row.
        overlong: What to do with an example longer than ``seq_len + 1`` tokens: ``"error"`` (refuse the data),
            ``"truncate"`` (cut it; what is cut is never trained on) or ``"drop"``; how many is said either way.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        data_path: str,
        tokenizer: str = "auto",
        seq_len: int = 1024,
        global_batch_size: int = 16,
        val_fraction: float = 0.05,
        test_fraction: float = 0.0,
        seed: int = 1234,
        packing: bool = True,
        overlong: str = "error",
        num_workers: int = 0,
    ) -> None:
        super().__init__(global_batch_size, seed, num_workers, tokenizer)
        if seq_len <= 0 or global_batch_size <= 0:
            raise ValueError(f"seq_len={seq_len} and global_batch_size={global_batch_size} must be positive")
        if overlong not in OVERLONG:
            raise ValueError(f"overlong={overlong!r} is not one of {', '.join(map(repr, OVERLONG))}")
        if not 0 < val_fraction < 1 or not 0 <= test_fraction < 1 - val_fraction:
            raise ValueError(f"val_fraction={val_fraction} and test_fraction={test_fraction} must leave training data")
        self.save_hyperparameters()
        self.seq_len, self.data_path = seq_len, data_path
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.packing, self.overlong = packing, overlong
        self.rows: list[dict[str, Any]] | None = read_rows(data_path)
        self.chat: ChatTemplate | None = None
        if tokenizer != AUTO:  # else when the model is known
            self.resolve_tokenizer()

    def _load_tokenizer(self, name: str) -> None:
        """Tokenize every example with the chat template of ``name``'s folder, and split and pack them."""
        if name == "byte":
            raise ValueError(
                f"chat data needs a tokenizer folder with a chat template, not {name!r}: give the data "
                "module tokenizer=FOLDER, or a model pretrained from a HuggingFace folder"
            )
        self.chat = ChatTemplate(name)
        rows, self.rows = self.rows, None  # (tokenized once)
        examples = self._examples(rows, self.overlong)
        order = np.random.default_rng(self.seed).permutation(len(examples))
        n_val = max(1, round(self.val_fraction * len(examples)))
        n_test = max(1, round(self.test_fraction * len(examples))) if self.test_fraction else 0
        split = np.split(order, [n_val, n_val + n_test])
        pack = ChatRows.packed if self.packing else ChatRows.one_per_row
        width, pad = self.seq_len + 1, self.chat.pad_id
        self.val_set, test, train = (pack([examples[i] for i in part], width, pad) for part in split)
        self.test_set = test if n_test else None
        self.train_set, self.train_examples = train, len(order) - n_val - n_test

    def training_shortfall(self) -> str | None:
        if self.train_set is None or len(self.train_set) >= self.global_batch_size:
            return None
        return (
            f"the {self.train_examples} training examples of {self.data_path!r} fill {len(self.train_set)} rows of "
            f"seq_len+1={self.seq_len + 1} tokens, fewer than global_batch_size={self.global_batch_size}"
        )

    def setup(self, stage: str | None = None) -> None:
        self.resolve_tokenizer()
        if stage in ("fit", None) and self.training_shortfall() is not None:
            raise ValueError(self.training_shortfall())

    @property
    def vocab_size(self) -> int:
        self.resolve_tokenizer()
        return self.chat.vocab_size

    def _examples(self, rows: list[dict[str, Any]], overlong: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every row tokenized (ids, answer mask), with the overlong ones handled as ``overlong`` says."""
        limit, examples, long = self.seq_len + 1, [], []
        for number, row in enumerate(rows):
            ids, answer = self.chat.encode(conversation(row, f"{self.data_path} row {number}"))
            if len(ids) > limit:
                long.append(len(ids))
                if overlong == "drop":
                    continue
                ids, answer = ids[:limit], answer[:limit]
            examples.append((ids, answer))
        if long:
            what = f"{len(long)} of the {len(rows)} examples of {self.data_path!r} are longer than seq_len+1={limit} "
            what += f"tokens (the longest: {max(long)})"
            if overlong == "error":
                raise ValueError(f"{what}; raise seq_len, or set overlong='truncate' or 'drop'")
            rank_zero_warn(f"{what}: {'cut to' if overlong == 'truncate' else 'dropped, not'} {limit} tokens")
        if not any(answer.any() for _, answer in examples):
            raise ValueError(f"no example of {self.data_path!r} has an answer token left to train on")
        return examples

    def _sampler(
        self, dataset: Any, per_step: int, replicas: int, rank: int, shuffle: bool, shares: Any = None
    ) -> TrainedTokenSampler:
        return TrainedTokenSampler(
            dataset,
            dataset.trained,
            self.seq_len,
            per_step,
            replicas,
            rank,
            shuffle=shuffle,
            seed=self.seed,
            shares=shares,
        )


@dataclass
class ChatRows(torch.utils.data.Dataset):
    """Rows of ``seq_len + 1`` tokens: ``input_ids``, ``positions`` (within each example, `lit3d.models.documents`) and
    ``loss_mask`` (the answer tokens); ``trained[i]``: row ``i``'s trained targets. Indexed by ``(row, loss_scale)``
    (`TrainedTokenSampler`)."""

    input_ids: np.ndarray
    positions: np.ndarray
    loss_mask: np.ndarray

    @property
    def trained(self) -> np.ndarray:
        return self.loss_mask[:, 1:].sum(axis=1)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: tuple[int, float]) -> dict[str, torch.Tensor]:
        row, scale = index
        return {
            "input_ids": torch.from_numpy(self.input_ids[row].astype(np.int64)),
            "positions": torch.from_numpy(self.positions[row].astype(np.int64)),
            "loss_mask": torch.from_numpy(self.loss_mask[row]),
            "loss_scale": torch.tensor(scale, dtype=torch.float32),
        }

    @classmethod
    def packed(cls, examples: list[tuple[np.ndarray, np.ndarray]], width: int, pad_id: int) -> ChatRows:
        """The examples, in order, each put whole into the current row if it fits there, else into a new one."""
        rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
        used = width
        for example in examples:
            if used + len(example[0]) > width:
                rows.append([])
                used = 0
            rows[-1].append(example)
            used += len(example[0])
        return cls._laid_out(rows, width, pad_id)

    @classmethod
    def one_per_row(cls, examples: list[tuple[np.ndarray, np.ndarray]], width: int, pad_id: int) -> ChatRows:
        return cls._laid_out([[example] for example in examples], width, pad_id)

    @classmethod
    def _laid_out(cls, rows: list[list[tuple[np.ndarray, np.ndarray]]], width: int, pad_id: int) -> ChatRows:
        ids = np.full((len(rows), width), pad_id, dtype=np.int32)
        mask, starts = np.zeros((len(rows), width), dtype=bool), np.zeros((len(rows), width), dtype=bool)
        for r, row in enumerate(rows):
            at = 0
            for tokens, answer in row:
                ids[r, at : at + len(tokens)], mask[r, at : at + len(tokens)] = tokens, answer
                starts[r, at] = True
                at += len(tokens)
            if at < width:  # the padding is a document of its own
                starts[r, at] = True
        return cls(ids, row_positions(starts), mask)
