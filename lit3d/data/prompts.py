"""What ``lit3d generate`` feeds the model: the prompt as text to continue, or with ``--chat`` (or a prompt that is a
conversation) the conversation rendered with the chat template of the model's tokenizer folder (as `ChatDataModule`
renders its training data), the assistant's turn opened, and the tokens that end that turn, where generation stops;
the answer is printed alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit3d.data import TextDataModule
from lit3d.data.chat_template import ROLES, ChatTemplate
from lit3d.data.tokenizers import ByteTokenizer
from lit3d.hf.pretrained import read_config, tokenizer_of


def prompt_data(ckpt_path: str, prompt: str, tokenizer: str | None, chat: bool) -> L.LightningDataModule:
    """The data module of one prompt: `ChatPrompt` for a conversation (`chat_messages`), else a `TextDataModule`.
    ``tokenizer``: the one given, else the model's (`tokenizer_of`); a model whose ids bytes cannot decode, and a
    conversation without a tokenizer folder, are refused."""

    config, chosen = read_config(ckpt_path), tokenizer or tokenizer_of(ckpt_path)
    if chosen is None and config.vocab_size > ByteTokenizer.vocab_size:  # bytes could not decode what it says
        raise ValueError(
            f"{ckpt_path!r} names no tokenizer (a model folder's tokenizer.json, or the one its run recorded), and "
            f"its vocab_size={config.vocab_size} is more than the byte tokenizer's {ByteTokenizer.vocab_size} ids: "
            "give --tokenizer, the tokenizer.json (or its folder) the model was trained with"
        )
    messages = chat_messages(prompt, chat)
    if messages is None:
        return TextDataModule(tokenizer=chosen or "byte", prompts=[prompt], seq_len=config.max_seq_len)
    if chosen in (None, "byte"):
        raise ValueError(f"--chat needs a tokenizer folder with a chat template; {ckpt_path!r} names none")
    return ChatPrompt(messages, chosen, ckpt_path)


def chat_messages(prompt: str, chat: bool) -> list[dict[str, str]] | None:
    """The conversation ``prompt`` holds: a JSON list of ``{"role", "content"}`` turns (or ``{"messages": [...]}``),
    or with ``chat`` one user turn of its text; None: plain text to continue."""
    turns = None
    if prompt.lstrip().startswith(("[", "{")):
        try:
            turns = json.loads(prompt)
        except ValueError:
            turns = None
    if isinstance(turns, dict):
        turns = turns.get("messages")
    if isinstance(turns, list) and turns and all(isinstance(turn, dict) and "role" in turn for turn in turns):
        for number, turn in enumerate(turns):
            if turn["role"] not in ROLES or not isinstance(turn.get("content"), str):
                what = f"role {turn['role']!r} is not one of {', '.join(ROLES)}, or its content is not text"
                raise ValueError(f"the prompt's turn {number}: {what}")
        return [{"role": turn["role"], "content": turn["content"]} for turn in turns]
    return [{"role": "user", "content": prompt}] if chat else None


class ChatPrompt(L.LightningDataModule):
    """One conversation to answer (``predict``): its tokens with the generation prompt, the ``stop_ids`` that end the
    assistant's turn, and a ``tokenizer`` that decodes an answer up to its end of turn (`PrintCompletions`).

    Args:
        messages: The conversation.
        tokenizer: The tokenizer folder (or its ``tokenizer.json``) whose chat template renders it.
        model: The model's folder: its ``generation_config.json`` may name more end-of-turn tokens.
    """

    def __init__(self, messages: list[dict[str, str]], tokenizer: str, model: str | None = None) -> None:
        super().__init__()
        try:
            self.chat = ChatTemplate(tokenizer)
        except (FileNotFoundError, ValueError) as error:
            raise ValueError(
                f"--chat renders the prompt with the chat template of the model's tokenizer: {error}"
            ) from None
        text = self.chat.render(messages, add_generation_prompt=True)
        self.ids = self.chat.tokenizer.encode(text, add_special_tokens=False).ids
        self.stop_ids = end_of_turn_ids(self.chat, [self.chat.folder, *([Path(model)] if model else [])])
        self.tokenizer = AnswerDecoder(self.chat, self.stop_ids)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader([{"input_ids": torch.tensor(self.ids, dtype=torch.long)}], batch_size=1)


class AnswerDecoder:
    """Decodes an answer's tokens up to (not including) the first end-of-turn token: what follows the last special
    token before it (gpt-oss's harmony format heads a message with ``<|channel|>final<|message|>``, and may first
    write its reasoning on another channel), or the whole where there is none (ChatML, Llama 3)."""

    def __init__(self, chat: ChatTemplate, stop_ids: tuple[int, ...]) -> None:
        self.chat, self.stop_ids = chat, stop_ids

    def decode(self, ids: list[int]) -> str:
        end = next((i for i, token in enumerate(ids) if token in self.stop_ids), len(ids))
        begin = max((i + 1 for i, token in enumerate(ids[:end]) if token in self.chat.special_tokens), default=0)
        return self.chat.tokenizer.decode(ids[begin:end], skip_special_tokens=True)


def end_of_turn_ids(chat: ChatTemplate, folders: list[Path]) -> tuple[int, ...]:
    """The tokens that end an assistant's turn: the tokenizer's ``eos_token`` and the ``eos_token_id`` (one or a
    list, as Llama 3's ``<|eot_id|>`` beside ``<|end_of_text|>``) of a ``generation_config.json`` in ``folders``."""
    ids: list[Any] = [chat.tokenizer.token_to_id(chat.special["eos_token"] or "")]
    for folder in folders:
        config = folder / "generation_config.json"
        if folder.is_dir() and config.is_file():
            eos = json.loads(config.read_text()).get("eos_token_id")
            ids.extend(eos if isinstance(eos, list) else [eos])
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int)))
