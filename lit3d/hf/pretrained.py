"""Weights to start from: a local HuggingFace Llama folder, or a lit3d checkpoint (a sharded folder written in any
layout, or the single file `lit3d convert` writes). One reading path for `GPT(pretrained=...)`,
`GPT.load_from_checkpoint`, `lit3d generate` and `lit3d export`.

NOTE: `lit3d.checkpoint` is imported where a lit3d checkpoint is read: it loads `torch.distributed.checkpoint`, which
``import lit3d; lit3d.GPT`` (and a start from a HuggingFace folder) does without."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lit3d.hf import folders as hf
from lit3d.hf.adapters import merge_adapters
from lit3d.models.config import GPTConfig
from lit3d.models.lora import LoRA


def is_hf_folder(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def read_checkpoint(path: str | Path) -> tuple[GPTConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, the network's whole tensors by name relative to ``GPT.model``, everything else Lightning saved)."""
    from lit3d.checkpoint.folder import is_sharded_checkpoint, read_weights
    from lit3d.checkpoint.safe_io import load_meta

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    checkpoint = read_weights(path) if is_sharded_checkpoint(path) else load_meta(path)
    config = _config_of(checkpoint, path)
    state = checkpoint.pop("state_dict")
    network = {name.removeprefix("model."): tensor for name, tensor in state.items() if name.startswith("model.")}
    return config, network, checkpoint


def _config_of(meta: dict[str, Any], path: str | Path) -> GPTConfig:
    """The model config a lit3d GPT saved in its hyper-parameters."""
    config = (meta.get("hyper_parameters") or {}).get("config")
    if config is None:
        raise ValueError(f"{str(path)!r} is not a checkpoint of a lit3d GPT (no model config in its hyper-parameters)")
    return GPTConfig.load(config)


def read_meta(path: str | Path) -> dict[str, Any]:
    """What Lightning saved in a lit3d checkpoint besides the weights (hyper-parameters, loops, ...): a folder's
    ``meta.pt``, or a whole single file."""
    from lit3d.checkpoint.folder import is_sharded_checkpoint
    from lit3d.checkpoint.safe_io import META_FILE, check_readable, load_meta

    if is_sharded_checkpoint(path):
        check_readable(Path(path))
        return load_meta(Path(path) / META_FILE)
    if not Path(path).is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    return load_meta(path)


def read_config(path: str | Path) -> GPTConfig:
    """The model shapes of a HuggingFace folder or a lit3d checkpoint, without reading a folder's weights."""

    if is_hf_folder(path):
        return hf.read_config(path)
    from lit3d.checkpoint.folder import is_sharded_checkpoint

    if not (is_sharded_checkpoint(path) or Path(path).is_file()):
        raise FileNotFoundError(
            f"{str(path)!r} is neither a HuggingFace model folder (config.json is missing) nor a lit3d checkpoint"
        )
    return _config_of(read_meta(path), path)


def read_tensors(path: str | Path, lora: LoRA | None = None) -> dict[str, torch.Tensor]:
    """The whole weights of a HuggingFace folder or a lit3d checkpoint, by lit3d name relative to ``GPT.model``.

    A LoRA run's trained adapters stay adapters for a model with the same ones (``lora``: rank, alpha and targets);
    for any other model they are merged into the weights they adapt, so it starts from what the run trained."""

    if is_hf_folder(path):
        config, tensors = hf.read_folder(path)
        return hf.to_lit3d_names(config, tensors)
    _, tensors, meta = read_checkpoint(path)
    trained = (meta.get("hyper_parameters") or {}).get("lora")
    if trained is not None and not _same_adapters(LoRA(**trained), lora):
        tensors = merge_adapters(tensors, LoRA(**trained))
    return tensors


def _same_adapters(trained: LoRA, lora: LoRA | None) -> bool:
    """Whether a model with ``lora`` holds the adapters of a run trained with ``trained`` (dropout only trains)."""
    return lora is not None and replace(trained, dropout=0.0) == replace(lora, dropout=0.0)


def tokenizer_of(path: str | Path) -> str | None:
    """The tokenizer a HuggingFace folder ships (``tokenizer.json``) or a lit3d run trained with."""
    if is_hf_folder(path):
        return str(Path(path) / "tokenizer.json") if (Path(path) / "tokenizer.json").is_file() else None
    return (read_meta(path).get("datamodule_hyper_parameters") or {}).get("tokenizer")
