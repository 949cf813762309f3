"""Shared by the tests: run a short fit and read back what the logger wrote."""

import csv
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger

from lit3d import GPT


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
    """Writes, per rank, where it runs: its node (from the launcher's environment) and its tensor-parallel group."""

    def on_train_start(self, trainer, pl_module):
        import json

        import torch.distributed as dist

        mesh = trainer.strategy.device_mesh
        record = {
            "rank": trainer.global_rank,
            "node": trainer.node_rank,
            "tp_group": dist.get_process_group_ranks(mesh["tensor_parallel"].get_group()),
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
