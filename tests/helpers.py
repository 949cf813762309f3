"""Shared by the tests: run a short fit and read back what the logger wrote."""

import csv
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import CSVLogger

from lit3d import GPT

# NOTE: a command-line test whose subject is not the launcher forks its ranks from the launching process: each child
# then skips importing Lightning again (about 7 s of a core per rank here: 10 s instead of 17 s for a 2-rank fit of
# 3 steps). The launcher users get by default (popen: each child runs the command again) is what tests/test_failures.py
# (ranks killed, hung, signalled) and tests/test_first_hour_messages.py run.
FORK = "--trainer.strategy.start_method=fork"


def logged(log_dir: Path, key: str) -> list[float]:
    """Values of one metric from a CSVLogger's metrics.csv, in step order."""
    with open(Path(log_dir) / "metrics.csv") as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]  # absent column: []


def fit(model, data, tmp_path, **trainer_kwargs) -> tuple[L.Trainer, Path]:
    """A quiet CPU fit logging every step; returns the trainer and the folder of its metrics.csv."""
    logger = CSVLogger(str(tmp_path), name="run")
    options = dict(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer = L.Trainer(**{**options, **trainer_kwargs})
    trainer.fit(model, data)
    return trainer, Path(logger.log_dir)


class GPTWithoutLossFn(GPT):
    """A module the strategy can split, but whose loss it cannot run as a pipeline schedule."""

    loss_fn = None


class RecordPlacement(L.Callback):
    """Writes, per rank, where it runs: its node (from the launcher's environment), its tensor-parallel group and its
    pipeline stage."""

    def on_train_start(self, trainer, pl_module):
        import json

        import torch.distributed as dist

        mesh = trainer.strategy.device_mesh
        record = {
            "rank": trainer.global_rank,
            "node": trainer.node_rank,
            "tp_group": dist.get_process_group_ranks(mesh["tensor_parallel"].get_group()),
            "stage": trainer.strategy.layout.coordinate(trainer.global_rank).p,
        }
        Path(f"placement_rank{trainer.global_rank}.json").write_text(json.dumps(record))


def tiny_llama(folder: Path, vocab_size: int = 256) -> Path:
    """A random tiny HuggingFace Llama (2 layers of 32, GQA 4/2), saved to ``folder`` as config.json + safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The shape of gpt-oss's harmony format (its folder's template also writes a system preamble and the analysis
# channel): a turn is <|start|>ROLE<|message|>...<|end|>, an answer is on the final channel, and the conversation's
# last answer ends with <|return|> instead of <|end|> (what the model emits to stop).
HARMONY = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m['content'] }}{{ '<|return|>' if loop.last else '<|end|>' }}"
    "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
HARMONY_TOKENS = ("<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>")
CHATML_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "why", "how", "answer", "is", "yes", "no"]


def byte_level_bpe(specials: list[str]) -> Any:
    """A small byte-level BPE `tokenizers.Tokenizer` trained on `WORDS`, with ``specials`` (ids 0, 1, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    return tokenizer


def chat_tokenizer(
    folder: Path, template: str | None = CHATML, specials: tuple[str, ...] = CHATML_TOKENS, eos: str = "<|im_end|>"
) -> Path:
    """A small byte-level BPE tokenizer folder with ``specials`` (ChatML's by default; ``specials[0]`` pads), its
    ``eos`` token and (unless None) a chat ``template``."""
    import json

    tokenizer = byte_level_bpe(list(specials))
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": eos, "pad_token": specials[0]}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def chat_file(path: Path, examples: int, seed: int = 0, max_words: int = 100) -> Path:
    """``examples`` prompt/response pairs as .jsonl, the answers from 1 to ``max_words`` words long (every other one a
    ``messages`` conversation with a system turn)."""
    import json
    import random

    rng = random.Random(seed)
    lines = []
    for i in range(examples):
        prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
        answer = " ".join(rng.choices(WORDS, k=1 if i == 0 else rng.randint(1, max_words)))
        if i % 2:
            turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt},
                     {"role": "assistant", "content": answer}]  # fmt: skip
            lines.append(json.dumps({"messages": turns}))
        else:
            lines.append(json.dumps({"prompt": prompt, "response": answer}))
    path.write_text("\n".join(lines) + "\n")
    return path


def tune_adapters(model, tokens_per_row: int, path: Path) -> Path:
    """Three AdamW steps of a LoRA ``model``'s adapters on random rows of ``tokens_per_row`` ids (it must train the
    adapters only), saved as a Lightning checkpoint at ``path`` (what ``lit3d export --adapter`` reads)."""
    import torch

    model.configure_model()
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained and all(name.endswith(("lora_a", "lora_b")) for name in trained)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for batch in torch.randint(0, 256, (3, 2, tokens_per_row), generator=torch.Generator().manual_seed(2)):
        optimizer.zero_grad()
        model.loss(batch).backward()
        optimizer.step()
    torch.save({"hyper_parameters": dict(model.hparams), "state_dict": model.state_dict()}, path)
    return path
