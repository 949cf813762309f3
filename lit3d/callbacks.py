"""Callbacks that show what training is doing."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


class SampleText(Callback):
    """After each validation run, decode a short sample from the model, so a user sees it learn.

    Every rank generates (model-parallel layouts need all ranks in each forward) with the same seeded
    generator, so all ranks feed the same tokens; rank 0 prints.

    Args:
        prompt: Text the sample starts from.
        max_new_tokens: Tokens to generate.
        temperature: Sampling temperature (0 is greedy).
        top_k: Sample among the k most likely tokens only.
        seed: Seed of the sampling generator (the global RNG is left untouched).
    """

    def __init__(
        self, prompt: str = "def ", max_new_tokens: int = 64, temperature: float = 0.8, top_k: int | None = 40,
        seed: int = 0,
    ) -> None:
        self.prompt, self.max_new_tokens, self.temperature, self.top_k, self.seed = (
            prompt, max_new_tokens, temperature, top_k, seed
        )

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        if trainer.sanity_checking or tokenizer is None or not hasattr(pl_module, "generate"):
            return
        prompt = torch.as_tensor(tokenizer.encode_batch([self.prompt])[0], dtype=torch.long, device=pl_module.device)
        generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
        tokens = pl_module.generate(prompt, self.max_new_tokens, self.temperature, self.top_k, generator=generator)
        if trainer.is_global_zero:
            text = tokenizer.decode(tokens.tolist())
            message = f"\n--- sample at step {trainer.global_step} ---\n{text}\n---"
            bar = trainer.progress_bar_callback
            bar.print(message) if bar is not None else print(message)
