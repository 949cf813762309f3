"""The ``config.json`` of a HuggingFace folder as a `GPTConfig`, for the families lit3d imports (`FAMILIES`;
DeepSeek-V3's fields in `lit3d.hf.deepseek`): what ``lit3d plan --model FOLDER`` reads, so it imports no torch (the
weights go through `lit3d.hf.folders`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lit3d.hf.deepseek import deepseek_from_hf, mtp_layers_in
from lit3d.hf.gemma import gemma_from_hf
from lit3d.hf.gpt_oss import gpt_oss_from_hf
from lit3d.models.config import FAMILIES, GPTConfig
from lit3d.models.rope_settings import ROPE_OPTIONS, ROPE_SCALINGS

# What other families' folders hold that lit3d does not compute, by config.json field.
NOT_COMPUTED = {
    "attn_logit_softcapping": "Gemma's attention logit soft-capping",
    "index_topk": "DeepSeek-V3.2's sparse attention (its indexer's top-k keys)",
    "index_n_heads": "DeepSeek-V3.2's sparse attention (its indexer's heads)",
    "index_head_dim": "DeepSeek-V3.2's sparse attention (its indexer's head width)",
    "partial_rotary_factor": "rotary embeddings on part of each head",
    "qk_layernorm": "LayerNorms on q and k",
}
# Families whose folders are another's: Kimi K2's config.json holds DeepSeek-V3's fields under its own model_type.
SAME_AS = {"kimi_k2": "deepseek_v3"}


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    """A `GPTConfig` from the ``config.json`` of one of `FAMILIES`; refuses what lit3d's model does not compute,
    naming the field."""
    model_type = SAME_AS.get(hf.get("model_type", "llama"), hf.get("model_type", "llama"))
    _refuse_uncomputed(hf, model_type)
    rope = hf.get("rope_parameters") or {}
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    moe = moe_from_hf(hf, model_type) if model_type in ("mixtral", "qwen3_moe") else {}
    qwen = model_type in ("qwen2", "qwen3", "qwen3_moe")  # (their windows are refused or unused: `_refuse_uncomputed`)
    fields = dict(
        name=hf.get("_name_or_path") or "hf",
        n_layer=hf["num_hidden_layers"],
        n_head=heads,
        n_kv_head=hf.get("num_key_value_heads") or heads,
        d_model=hf["hidden_size"],
        d_ff=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling(hf),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        head_dim=head_dim if head_dim * heads != hf["hidden_size"] else None,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        qkv_bias=model_type == "qwen2",
        family=model_type,
        sliding_window=None if qwen else hf.get("sliding_window"),
        layer_types=None if qwen else hf.get("layer_types"),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
        **moe,
    )
    own = {"deepseek_v3": deepseek_from_hf, "gpt_oss": gpt_oss_from_hf, "gemma3_text": gemma_from_hf}
    return GPTConfig(**fields | (own[model_type](hf) if model_type in own else {}))


def _refuse_uncomputed(hf: dict[str, Any], model_type: str) -> None:
    """A family or a field lit3d's model does not compute, named, before anything is built."""
    uncomputed = {field: what for field, what in NOT_COMPUTED.items() if hf.get(field) not in (None, False, 1.0)}
    if model_type not in FAMILIES:
        also = f" ({', '.join(f'{k}: {v}' for k, v in uncomputed.items())} is not computed)" if uncomputed else ""
        raise ValueError(f"model_type={model_type!r}: lit3d imports {', '.join(FAMILIES)} folders{also}")
    if uncomputed:
        field, what = next(iter(uncomputed.items()))
        raise ValueError(f"{field}={hf[field]}: {what} is not computed by lit3d")
    quantized = hf.get("quantization_config")
    if quantized:  # NOTE: refused before a weight is read: FP8 blocks read as plain tensors would be noise
        blocks = quantized.get("weight_block_size")
        what = f"weights block-quantized (weight_block_size={blocks})" if blocks else "quantized weights"
        raise ValueError(
            f"quantization_config={quantized}: {what} are not read by lit3d; dequantize the folder (to bf16) first"
        )
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and hf.get("use_sliding_window"):
        raise ValueError(
            f"use_sliding_window=True (sliding_window={hf.get('sliding_window')}, max_window_layers="
            f"{hf.get('max_window_layers')}): Qwen's windowed lower layers are not computed by lit3d"
        )
    for flag in ("attention_bias", "mlp_bias"):  # (Qwen2's q/k/v biases are not these flags; gpt-oss's are its own)
        if hf.get(flag) and model_type != "gpt_oss":
            raise ValueError(f"{flag}=True is not supported (lit3d's linears have no bias but Qwen2's q, k and v)")
    if model_type not in ("gpt_oss", "gemma3_text") and hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (lit3d's MLP is SwiGLU with SiLU)")


def _rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    """The rotary scaling of a ``config.json`` (``rope_scaling``, or transformers 5's ``rope_parameters``) as
    `GPTConfig.rope_scaling`: its type and the parameters that type reads; None for plain rotary embeddings. A type
    lit3d does not compute is refused by `GPTConfig`, naming it."""
    scaling = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "yarn":  # transformers' defaults: the pretrained context is the whole one, the factor their ratio
        original = scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
        if scaling.get("factor") is None and original:
            scaling["factor"] = hf["max_position_embeddings"] / original
    names = ROPE_SCALINGS.get(kind, ()) + ROPE_OPTIONS.get(kind, ())
    return {"rope_type": kind, **{k: scaling[k] for k in names if scaling.get(k) is not None}}


def moe_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The `GPTConfig` fields of a Mixtral or Qwen3-MoE ``config.json``; refuses Qwen3-MoE's dense layers between
    the MoE ones, which lit3d does not place."""
    if model_type == "mixtral":
        experts = dict(n_expert=hf["num_local_experts"], d_ff_expert=hf["intermediate_size"])
        return experts | dict(
            n_expert_per_token=hf["num_experts_per_tok"], aux_loss_coef=hf.get("router_aux_loss_coef", 0.02)
        )
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise ValueError(
            f"decoder_sparse_step={step}, mlp_only_layers={dense}: lit3d's MoE models have MoE feed-forwards in "
            "every block (after first_dense_layers), not dense ones between them"
        )
    return dict(
        n_expert=hf.get("num_experts", hf.get("num_local_experts")),
        n_expert_per_token=hf["num_experts_per_tok"],
        d_ff_expert=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
    )


def read_config(path: str | Path) -> GPTConfig:
    """The `GPTConfig` of a local HuggingFace folder's ``config.json`` (``path``: the folder or that file), named after
    the folder unless the file names the model; with the multi-token-prediction depths it asks for that the folder
    holds (DeepSeek-V3's: `lit3d.hf.deepseek.mtp_layers_in`)."""
    path = Path(path)
    file = path if path.name == "config.json" else path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a HuggingFace model folder: config.json is missing")
    hf = json.loads(file.read_text())
    config = config_from_hf({**hf, "_name_or_path": hf.get("_name_or_path") or file.resolve().parent.name})
    if not config.num_nextn_predict_layers:
        return config
    held = mtp_layers_in(file.resolve().parent, config.n_layer, config.num_nextn_predict_layers)
    return config.replace(num_nextn_predict_layers=held)  # (the multi-token-prediction depths it holds)
