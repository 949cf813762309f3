"""Sampling the next token: temperature, top-k and top-p (nucleus), the settings `GPT.generate` and ``lit3d
generate`` take."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sampling:
    """How `GPT` continues a prompt (``predict``, ``lit3d generate``).

    Args:
        max_new_tokens: Tokens to generate after the prompt.
        temperature: Divides the logits; 0 picks the most likely token (greedy).
        top_k: Sample among the k most likely tokens only.
        top_p: Sample among the most likely tokens whose probabilities add up to p (nucleus sampling).
        seed: Seed of the sampling generator; every rank of a model-parallel layout uses the same, so all feed
            the same tokens.
        stop_ids: Tokens that end a sequence (a chat's end of turn): generation stops once every sequence has
            sampled one.
    """

    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0 or self.temperature < 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} and temperature={self.temperature} must be >= 0")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be at least 1")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1]")


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """``[batch, vocab]`` fp32 logits → ``[batch, 1]`` token ids."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / sampling.temperature
    if sampling.top_k is not None:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None:
        ordered, order = logits.sort(dim=-1, descending=True)
        before = ordered.softmax(dim=-1).cumsum(dim=-1) - ordered.softmax(dim=-1)  # mass of the tokens ahead
        drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, before >= sampling.top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
