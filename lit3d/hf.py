"""HuggingFace Llama folders in and out: ``config.json`` + safetensors, local folders only (no hub).

The layouts match one to one (lit3d uses HuggingFace's rotate-half rotary convention), so weights are renamed,
never permuted; lit3d's vocabulary padding rows are added on import and dropped on export.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from lit3d.config import GPTConfig

# lit3d name (relative to the Transformer) -> HuggingFace name; {i} is the block index.
NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "blocks.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blocks.{i}.attn.q_proj.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blocks.{i}.attn.k_proj.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blocks.{i}.attn.v_proj.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blocks.{i}.attn.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blocks.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blocks.{i}.mlp.gate_proj.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blocks.{i}.mlp.up_proj.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blocks.{i}.mlp.down_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """lit3d → HuggingFace parameter name."""
    block = re.match(r"blocks\.(\d+)\.", name)
    pattern = re.sub(r"^blocks\.\d+\.", "blocks.{i}.", name)
    if pattern not in NAMES:
        raise KeyError(f"no HuggingFace name for lit3d parameter {name!r}")
    return NAMES[pattern].format(i=block.group(1) if block else "")


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    """A `GPTConfig` from a Llama ``config.json``; refuses what lit3d's model does not compute."""
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"model_type={hf.get('model_type')!r}: only Llama folders can be imported")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or ({} if rope.get("rope_type", "default") == "default" else rope)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"rope scaling {scaling} is not supported (lit3d computes plain rotary embeddings)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"{flag}=True is not supported (lit3d's linears have no bias)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (lit3d's MLP is SwiGLU with SiLU)")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        raise ValueError(f"head_dim={head_dim} x num_attention_heads={heads} != hidden_size={hf['hidden_size']}")
    return GPTConfig(
        name=hf.get("_name_or_path") or "hf",
        n_layer=hf["num_hidden_layers"],
        n_head=heads,
        n_kv_head=hf.get("num_key_value_heads") or heads,
        d_model=hf["hidden_size"],
        d_ff=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def config_to_hf(config: GPTConfig, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
    }


def read_config(folder: str | Path) -> GPTConfig:
    """The `GPTConfig` of a local HuggingFace folder's ``config.json``."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{str(folder)!r} is not a HuggingFace model folder: config.json is missing")
    return config_from_hf(json.loads((folder / "config.json").read_text()))


def read_folder(folder: str | Path) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """(config, HuggingFace-named tensors) of a local folder with ``config.json`` and safetensors files."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = read_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {str(folder)!r} (PyTorch .bin weights are not read)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return config, tensors


def to_lit3d_names(config: GPTConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HuggingFace-named tensors → lit3d names (relative to the `Transformer`), checked against the model's shapes.

    The vocabulary tensors keep HuggingFace's rows; lit3d's padding rows are added (as zeros) when the weights
    are copied into the model (`Transformer.reset_parameters`).
    """
    from lit3d.model import Transformer

    with torch.device("meta"):
        network = Transformer(config)
    out, missing, wrong = {}, [], []
    for name, param in network.named_parameters():  # a tied head shares the embedding: not listed again
        key = hf_name(name)
        if key not in tensors:
            missing.append(key)
            continue
        value = tensors[key]
        vocabulary = name in ("embed.weight", "head.weight")  # lit3d pads these rows
        expected = (config.vocab_size, *param.shape[1:]) if vocabulary else tuple(param.shape)
        if tuple(value.shape) != expected:
            wrong.append(f"{key}: {tuple(value.shape)}, expected {expected}")
            continue
        out[name] = value
    if missing or wrong:
        raise ValueError(f"the HuggingFace weights do not fit: missing {missing[:5]}, mismatched {wrong[:5]}")
    return out


def write_folder(
    folder: str | Path, config: GPTConfig, network_state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> Path:
    """Write a HuggingFace Llama folder from a lit3d `Transformer` state dict (names relative to it)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, value in network_state.items():
        if name == "head.weight" and config.tie_embeddings:
            continue
        if name in ("embed.weight", "head.weight"):
            value = value[: config.vocab_size]  # drop lit3d's padding rows
        tensors[hf_name(name)] = value.to(dtype).contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config_to_hf(config, dtype), indent=2))
    return folder


def export_checkpoint(ckpt_path: str | Path, output: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """A lit3d checkpoint of any layout → a HuggingFace Llama folder (one process, no GPU needed).

    The sharded tensors are read whole with `torch.distributed.checkpoint` (`lit3d.pretrained.read_checkpoint`),
    which reassembles the shards of every layout from their recorded global offsets.
    """
    from lit3d.pretrained import read_checkpoint

    config, network_state, meta = read_checkpoint(ckpt_path)
    folder = write_folder(output, config, network_state, dtype)
    tokenizer = meta.get("datamodule_hyper_parameters", {}).get("tokenizer")
    if tokenizer and tokenizer != "byte" and Path(tokenizer).exists():
        source = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
        (folder / "tokenizer.json").write_bytes(source.read_bytes())
    return folder
