"""DeepSeek-V3's ``config.json`` as `GPTConfig` fields and back: multi-head latent attention
(`lit3d.models.latent_attention`), DeepSeekMoE's routing (`lit3d.models.moe.Router`) and multi-token prediction
(`lit3d.models.mtp`). Moonlight's folders are ``deepseek_v3`` ones, and Kimi K2's (``kimi_k2``) hold the same fields.
No torch: ``lit3d plan`` reads these.

DeepSeek-V3's folders hold multi-token prediction's depths as decoder layers after the model's, ``model.layers.{N +
k}`` for lit3d's ``mtp.{k}`` (N = ``num_hidden_layers``): the block's weights under the usual names, and ``enorm``,
``hnorm``, ``eh_proj`` and ``shared_head.norm`` beside them (and copies of the embedding and the head, which lit3d's
depths share with the model). A folder is read with the depths its ``config.json`` asks for and holds
(`mtp_layers_in`): transformers writes ``num_nextn_predict_layers`` (1 by default) into folders without them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from lit3d.models.config import GPTConfig
from lit3d.outputs import safetensors_header

# transformers' `DeepseekV3Config` defaults, for the fields a config.json leaves out.
DEFAULTS = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "rope_interleave": True,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 1,
}
# What DeepSeek's own config.json files name that transformers' model (and lit3d's) computes one way only.
ONLY = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def deepseek_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The `GPTConfig` fields of a DeepSeek-V3 ``config.json`` besides the common ones; refuses a routing other than
    DeepSeek-V3's, naming the field. ``num_nextn_predict_layers`` as the file says (`mtp_layers_in` counts the depths
    a folder holds)."""
    other = {field: hf[field] for field, only in ONLY.items() if hf.get(field, only) != only}
    if other:
        field, value = next(iter(other.items()))
        raise ValueError(f"{field}={value!r} is not computed by lit3d (DeepSeek-V3's is {field}={ONLY[field]!r})")
    balance = hf.get("aux_loss_alpha", 1e-4)  # DeepSeek's own config.json files name it; the paper's is 1e-4
    hf = DEFAULTS | {field: value for field, value in hf.items() if field in DEFAULTS}
    return dict(
        n_kv_head=None,
        head_dim=None,
        kv_lora_rank=hf["kv_lora_rank"],
        q_lora_rank=hf["q_lora_rank"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rope_interleave=bool(hf["rope_interleave"]),
        n_expert=hf["n_routed_experts"] or 0,
        n_expert_per_token=hf["num_experts_per_tok"],
        d_ff_expert=hf["moe_intermediate_size"],
        n_shared_experts=hf["n_shared_experts"] or 0,
        first_dense_layers=hf["first_k_dense_replace"] or 0,
        router="sigmoid",
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        n_group=hf["n_group"] or 1,
        topk_group=hf["topk_group"] or 1,
        routed_scaling_factor=float(hf["routed_scaling_factor"]),
        aux_loss_coef=balance,
        num_nextn_predict_layers=hf["num_nextn_predict_layers"] or 0,
    )


def mtp_layers_in(folder: Path, n_layer: int, asked: int) -> int:
    """How many of the ``asked`` multi-token-prediction depths ``folder`` holds (their ``eh_proj``, after the
    ``n_layer`` decoder layers), read from its safetensors index or the files' headers."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text()).get("weight_map", {}))
    else:
        names = {name for file in folder.glob("*.safetensors") for name in safetensors_header(file)}
    return next((k for k in range(asked) if f"model.layers.{n_layer + k}.eh_proj.weight" not in names), asked)


MTP_PARAM = re.compile(r"mtp\.(\d+)\.(.+)$")
# A depth's own weights beside its block, by lit3d name within the depth.
MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
           "norm.weight": "shared_head.norm.weight"}  # fmt: skip


def mtp_own_name(name: str, n_layer: int) -> str | None:
    """The HuggingFace name of a multi-token-prediction depth's own weight (``mtp.{k}.enorm.weight``, ...); None for
    any other."""
    match = MTP_PARAM.match(name)
    if match is None or match.group(2) not in MTP_OWN:
        return None
    return f"model.layers.{n_layer + int(match.group(1))}.{MTP_OWN[match.group(2)]}"


def as_block_name(name: str, n_layer: int) -> str:
    """A depth's block weight under the name of the decoder block its folder holds it as (``mtp.{k}.block.X`` →
    ``blocks.{n_layer + k}.X``); any other name as it is."""
    match = MTP_PARAM.match(name)
    if match is None or not match.group(2).startswith("block."):
        return name
    return f"blocks.{n_layer + int(match.group(1))}.{match.group(2).removeprefix('block.')}"


def deepseek_to_hf(config: GPTConfig) -> dict[str, Any]:
    """The DeepSeek-V3 fields of an exported ``config.json``; refuses a model that transformers' DeepSeek-V3 does not
    compute, naming the field."""
    if config.kv_lora_rank is None or (config.n_expert and config.router != "sigmoid"):
        raise ValueError(
            f"a deepseek_v3 folder cannot hold kv_lora_rank={config.kv_lora_rank}, router={config.router!r} "
            "(DeepSeek-V3: latent attention and the sigmoid router)"
        )
    return {
        "head_dim": config.qk_rope_head_dim,  # (transformers' DeepSeek-V3 writes the rotated part's width here)
        "kv_lora_rank": config.kv_lora_rank,
        "q_lora_rank": config.q_lora_rank,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "v_head_dim": config.v_head_dim,
        "rope_interleave": config.rope_interleave,
        "n_routed_experts": config.n_expert,
        "num_experts_per_tok": config.n_expert_per_token,
        "moe_intermediate_size": config.d_ff_expert,
        "n_shared_experts": config.n_shared_experts,
        "first_k_dense_replace": config.first_dense_layers if config.n_expert else config.n_layer,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "routed_scaling_factor": config.routed_scaling_factor,
        "norm_topk_prob": config.norm_topk_prob,
        # NOTE: the depths are not written (transformers' DeepseekV3ForCausalLM has none), so the file says so: a
        # folder that asked for them would send transformers' multi-token drafting (`generate(use_mtp=True)`) after
        # weights it does not hold.
        "num_nextn_predict_layers": 0,
    }
