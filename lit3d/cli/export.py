"""A lit3d checkpoint of any layout out as a HuggingFace folder: the weights (`lit3d.hf.folders.write_folder`), what
generation needs from where they came from (token ids, ``generation_config.json``), and the run's tokenizer; or a
LoRA run's adapters alone, as a PEFT folder.

NOTE: `lit3d export`'s work sits with the command: it puts `lit3d.hf`'s weights beside `lit3d.data`'s tokenizer, and
`lit3d.hf` sits below the data, which reads a model folder's tokenizer (`lit3d.hf.pretrained.tokenizer_of`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lit3d.data.tokenizers import TOKENIZER_FILES, export_tokenizer, load_tokenizer
from lit3d.hf.adapters import merge_adapters, write_adapter
from lit3d.hf.folders import write_folder
from lit3d.hf.pretrained import is_hf_folder, read_checkpoint, read_meta
from lit3d.models.lora import LoRA
from lit3d.outputs import check_output, is_export_folder, make_folder, written

TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# What an export may put in its folder (`lit3d.outputs.make_folder`): a model's, or (``adapter``) a PEFT folder's.
MODEL_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", *TOKENIZER_FILES)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def export_checkpoint(
    ckpt_path: str | Path,
    output: str | Path,
    dtype: torch.dtype = torch.float32,
    adapter: bool = False,
    overwrite: bool = False,
) -> tuple[Path, list[str], list[str]]:
    """A lit3d checkpoint of any layout → a HuggingFace folder of its family (one process, no GPU needed), the names
    of the files written there, and one line per thing generation needs on where it came from (token ids, generation
    config, tokenizer). A LoRA run's adapters are merged into their linears, or with ``adapter`` written alone as a
    PEFT folder (`lit3d.hf.adapters`).

    Into an existing folder: an earlier export's files are replaced; a user's files of the names an export writes are
    refused before anything is read, unless ``overwrite`` (`lit3d.outputs`); other files are left beside.

    The sharded tensors are read whole with `torch.distributed.checkpoint` (`lit3d.hf.pretrained.read_checkpoint`),
    which reassembles the shards of every layout from their recorded global offsets. The BOS/EOS/pad ids and
    ``generation_config.json`` are the HuggingFace folder's the weights started from (`source_folder`); else the
    run's tokenizer's ids. The tokenizer is the run's own (`lit3d.data.tokenizers.export_tokenizer`).
    """
    import shutil

    names = ADAPTER_FILES if adapter else MODEL_FILES
    check_output(output, "HuggingFace export", is_export_folder, names, overwrite)  # before the checkpoint is read
    config, network_state, meta = read_checkpoint(ckpt_path)
    source, notes = source_folder(meta)
    lora = (meta.get("hyper_parameters") or {}).get("lora")
    if adapter:
        base = str(source.resolve()) if source is not None else None  # a relative path would be read as a hub id
        if lora is None:
            raise ValueError(f"{str(ckpt_path)!r} was trained without LoRA adapters: export it without --adapter")
        output = make_folder(output, "HuggingFace export", is_export_folder, names, overwrite)
        folder = write_adapter(output, network_state, LoRA(**lora), base)
        note = f"LoRA adapters (rank {lora['rank']}, {', '.join(lora['targets'])}) for the base {base!r}"
        return folder, written(folder, names), [note]
    if lora is not None:
        network_state = merge_adapters(network_state, LoRA(**lora))
        notes.append(f"LoRA adapters (rank {lora['rank']}) merged into their linears")
    tokenizer = (meta.get("datamodule_hyper_parameters") or {}).get("tokenizer")
    if tokenizer is None and source is not None and (source / "tokenizer.json").is_file():
        tokenizer = str(source)  # NOTE: a run without a datamodule (plain dataloaders) kept the source's
    if source is not None:
        hf = json.loads((source / "config.json").read_text())
        token_ids = {key: hf[key] for key in TOKEN_IDS if key in hf}
    else:
        token_ids = _tokenizer_ids(tokenizer)
    output = make_folder(output, "HuggingFace export", is_export_folder, names, overwrite)
    folder = write_folder(output, config, network_state, dtype, token_ids)
    ids = ", ".join(f"{key}={value}" for key, value in token_ids.items() if value is not None)
    origin = f"{str(source)!r}" if source is not None else f"the tokenizer {tokenizer!r}"
    if ids:
        notes.append(f"token ids: {ids} from {origin}")
    else:  # NOTE: null rather than LlamaConfig's defaults, which would stop generation at the wrong token
        why = "the byte tokenizer has no BOS/EOS" if tokenizer == "byte" else "no source folder or tokenizer names them"
        notes.append(f"token ids: none ({why}; config.json says null, so generation stops at max_new_tokens)")
    if source is not None and (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", folder / "generation_config.json")
        notes.append(f"generation_config.json: copied from {str(source)!r}")
    notes.append(export_tokenizer(tokenizer, folder, config.max_seq_len))
    return folder, written(folder, names), notes


def source_folder(meta: dict[str, Any]) -> tuple[Path | None, list[str]]:
    """The HuggingFace folder a checkpoint's weights started from (``GPT(pretrained=...)``, followed back through
    lit3d checkpoints that started from one), and a note when that folder is gone."""

    pretrained, seen = (meta.get("hyper_parameters") or {}).get("pretrained"), set()
    while pretrained and pretrained not in seen:
        seen.add(pretrained)
        if is_hf_folder(pretrained):
            return Path(pretrained), []
        if not Path(pretrained).exists():
            return None, [f"source: {pretrained!r}, where the weights started, is gone: its token ids are not kept"]
        pretrained = (read_meta(pretrained).get("hyper_parameters") or {}).get("pretrained")
    return None, []


def _tokenizer_ids(tokenizer: str | None) -> dict[str, Any]:
    """BOS/EOS of the run's tokenizer (None where it has none, rather than LlamaConfig's defaults 1 and 2)."""

    try:
        loaded = load_tokenizer(tokenizer) if tokenizer else None
    except (FileNotFoundError, ValueError):
        loaded = None  # NOTE: `export_tokenizer` says so
    return {"bos_token_id": getattr(loaded, "bos_id", None), "eos_token_id": getattr(loaded, "eos_id", None)}
