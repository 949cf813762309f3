"""HuggingFace Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE and DeepSeek-V3 folders in and out: ``config.json`` +
safetensors, local folders only (no hub).

The layouts match one to one (lit3d uses HuggingFace's rotate-half rotary convention), so weights are renamed,
never permuted; lit3d's vocabulary padding rows are added on import and dropped on export. The MoE families'
routers and experts are named and stacked in `lit3d.hf.experts`; a checkpoint goes out through `lit3d.cli.export`.
A folder's ``config.json`` is read by `lit3d.hf.config` (no torch: ``lit3d plan`` reads it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from lit3d.hf.config import config_from_hf, read_config  # noqa: F401 (read from here too)
from lit3d.hf.deepseek import as_block_name, deepseek_to_hf, mtp_own_name
from lit3d.hf.experts import expert_name, moe_family, moe_to_hf, read_experts, write_experts
from lit3d.hf.gemma import NORMS as GEMMA_NORMS
from lit3d.hf.gemma import gemma_to_hf
from lit3d.hf.gpt_oss import experts_to_hf, gpt_oss_to_hf
from lit3d.models.config import FAMILIES, GPTConfig
from lit3d.models.transformer import Transformer
from lit3d.outputs import MARK

# lit3d name (relative to the Transformer) -> HuggingFace name; {i} is the block index.
NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "blocks.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blocks.{i}.attn.q_proj.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blocks.{i}.attn.k_proj.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blocks.{i}.attn.v_proj.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blocks.{i}.attn.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blocks.{i}.attn.o_proj.bias": "model.layers.{i}.self_attn.o_proj.bias",  # gpt-oss
    "blocks.{i}.attn.sinks.weight": "model.layers.{i}.self_attn.sinks",
    "blocks.{i}.attn.q_proj.bias": "model.layers.{i}.self_attn.q_proj.bias",  # Qwen2
    "blocks.{i}.attn.k_proj.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blocks.{i}.attn.v_proj.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blocks.{i}.attn.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",  # Qwen3
    "blocks.{i}.attn.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blocks.{i}.attn.q_a_proj.weight": "model.layers.{i}.self_attn.q_a_proj.weight",  # DeepSeek-V3's latent attention
    "blocks.{i}.attn.q_a_layernorm.weight": "model.layers.{i}.self_attn.q_a_layernorm.weight",
    "blocks.{i}.attn.q_b_proj.weight": "model.layers.{i}.self_attn.q_b_proj.weight",
    "blocks.{i}.attn.kv_a_proj_with_mqa.weight": "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight",
    "blocks.{i}.attn.kv_a_layernorm.weight": "model.layers.{i}.self_attn.kv_a_layernorm.weight",
    "blocks.{i}.attn.kv_b_proj.weight": "model.layers.{i}.self_attn.kv_b_proj.weight",
    "blocks.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blocks.{i}.mlp.gate_proj.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blocks.{i}.mlp.up_proj.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blocks.{i}.mlp.down_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blocks.{i}.mlp.shared.gate_proj.weight": "model.layers.{i}.mlp.shared_experts.gate_proj.weight",  # DeepSeek-V3
    "blocks.{i}.mlp.shared.up_proj.weight": "model.layers.{i}.mlp.shared_experts.up_proj.weight",
    "blocks.{i}.mlp.shared.down_proj.weight": "model.layers.{i}.mlp.shared_experts.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}


def hf_name(name: str, family: str = "mixtral") -> str:
    """lit3d → HuggingFace parameter name (an MoE model's routers and experts as ``family`` names them, ``{e}`` left
    for the expert)."""
    moe = expert_name(name, family)
    if moe is not None:
        return moe
    block = re.match(r"blocks\.(\d+)\.", name)
    norm = re.match(r"blocks\.\d+\.(\w+)\.weight$", name)
    if family == "gemma3_text" and norm and norm.group(1) in GEMMA_NORMS:  # four norms, named apart
        return f"model.layers.{block.group(1)}.{GEMMA_NORMS[norm.group(1)]}.weight"
    pattern = re.sub(r"^blocks\.\d+\.", "blocks.{i}.", name)
    if pattern not in NAMES:
        raise KeyError(f"no HuggingFace name for lit3d parameter {name!r}")
    return NAMES[pattern].format(i=block.group(1) if block else "")


def hf_family(config: GPTConfig) -> str:
    """The ``model_type`` a model exports as: its family (`GPTConfig.family`), or that family's MoE one."""
    if config.n_expert:
        return moe_family(config)
    return {"mixtral": "mistral", "qwen3_moe": "qwen3"}.get(config.family, config.family)


def config_to_hf(config: GPTConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of `hf_family`; refuses a model that family cannot hold, naming the field."""
    family = hf_family(config)
    if (config.kv_lora_rank is not None) != (family == "deepseek_v3"):
        raise ValueError(
            f"a {family} folder cannot hold kv_lora_rank={config.kv_lora_rank} (DeepSeek's latent attention)"
        )
    if config.qk_norm != (family in ("qwen3", "qwen3_moe", "gemma3_text")):
        raise ValueError(f"a {family} folder cannot hold qk_norm={config.qk_norm} (Qwen3's per-head q/k norms)")
    if config.qkv_bias != (family == "qwen2"):
        raise ValueError(f"a {family} folder cannot hold qkv_bias={config.qkv_bias} (Qwen2's q, k and v biases)")
    foreign = {
        "attention_sinks": False, "attention_bias": False, "mlp_bias": False, "swiglu_limit": None,
        "sandwich_norm": False, "norm_unit_offset": False, "scale_embeddings": False, "query_pre_attn_scalar": None,
        "rope_local_base_freq": None, "hidden_act": "silu", "final_logit_softcapping": None,
    }  # fmt: skip
    own = {"gpt_oss": ("attention_sinks", "attention_bias", "mlp_bias", "swiglu_limit")}
    own["gemma3_text"] = tuple(k for k in foreign if k not in own["gpt_oss"])
    held = {
        k: getattr(config, k) for k, v in foreign.items() if getattr(config, k) != v and k not in own.get(family, ())
    }
    if held:
        raise ValueError(f"a {family} folder cannot hold {held} (gpt-oss's and Gemma's settings, each its family's)")
    windowed = {"sliding_window": config.sliding_window, "use_sliding_window": config.sliding_window is not None}
    if config.layer_types is not None or family in ("gpt_oss", "gemma3_text"):
        windowed["layer_types"] = [
            "full_attention" if config.window(i) is None else "sliding_attention" for i in range(config.n_layer)
        ]
    fields = {"deepseek_v3": deepseek_to_hf, "gpt_oss": gpt_oss_to_hf, "gemma3_text": gemma_to_hf}
    return {
        "architectures": [FAMILIES[family]],
        "model_type": family,
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
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta, **(config.rope_scaling or {})},
        "rope_scaling": config.rope_scaling,
        **windowed,
    } | (fields[family](config) if family in fields else moe_to_hf(config) if config.n_expert else {})


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

    with torch.device("meta"):
        network = Transformer(config)
    experts = read_experts(config, tensors) if config.n_expert else {}
    out, missing, wrong = {}, [], []
    biases = [(name, buffer) for name, buffer in network.named_buffers() if name.endswith("expert_bias")]
    for name, param in [*network.named_parameters(), *biases]:  # a tied head shares the embedding: not listed again
        block = as_block_name(name, config.n_layer)  # (a multi-token-prediction depth's block: a layer after the rest)
        key = mtp_own_name(name, config.n_layer) or hf_name(block, hf_family(config)).replace(".{e}.", ".*.")
        value = experts.get(block, tensors.get(key))
        if value is None:
            missing.append(key)
            continue
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
    folder: str | Path,
    config: GPTConfig,
    network_state: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    token_ids: dict[str, Any] | None = None,
) -> Path:
    """Write a HuggingFace folder of `hf_family` from a lit3d `Transformer` state dict (names relative to it);
    ``token_ids`` (``bos_token_id``, ``eos_token_id``, ...) go into its ``config.json``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    family, hf = hf_family(config), config_to_hf(config, dtype)
    tensors = {}
    if family == "gpt_oss":  # its experts fused (`lit3d.hf.gpt_oss`)
        fused = experts_to_hf(network_state)
        tensors |= {name: value.to(dtype) for name, value in fused.items()}
        network_state = {k: v for k, v in network_state.items() if not re.search(r"\.mlp\.(router|experts)\.", k)}
    for name, value in network_state.items():
        if (name == "head.weight" and config.tie_embeddings) or name.startswith("mtp."):  # (see `deepseek_to_hf`)
            continue
        if name in ("embed.weight", "head.weight"):
            value = value[: config.vocab_size]  # drop lit3d's padding rows
        if ".mlp.experts." in name:  # one [out, in] matrix per expert, as published checkpoints hold them
            tensors |= write_experts(name, value.to(dtype), family)
            continue
        kept = torch.float32 if name.endswith("expert_bias") else dtype  # (DeepSeek-V3 keeps its bias in fp32)
        tensors[hf_name(name, family)] = value.to(kept).contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt", **MARK})  # `is_export_folder`
    (folder / "config.json").write_text(json.dumps(hf | (token_ids or {}), indent=2))
    return folder
