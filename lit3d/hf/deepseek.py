"""DeepSeek-V3's ``config.json`` as `GPTConfig` fields and back: multi-head latent attention
(`lit3d.models.latent_attention`) and DeepSeekMoE's routing (`lit3d.models.moe.Router`). Moonlight's folders are
``deepseek_v3`` ones, and Kimi K2's (``kimi_k2``) hold the same fields. No torch: ``lit3d plan`` reads these."""

from __future__ import annotations

from typing import Any

from lit3d.models.config import GPTConfig

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
}
# What DeepSeek's own config.json files name that transformers' model (and lit3d's) computes one way only.
ONLY = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def deepseek_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The `GPTConfig` fields of a DeepSeek-V3 ``config.json`` besides the common ones; refuses a routing other than
    DeepSeek-V3's, naming the field. Multi-token prediction (``num_nextn_predict_layers``) is not read: its layers,
    which transformers' model has neither, are left in the folder."""
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
        n_shared_expert=hf["n_shared_experts"] or 0,
        first_dense_layers=hf["first_k_dense_replace"] or 0,
        router="sigmoid",
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        n_group=hf["n_group"] or 1,
        topk_group=hf["topk_group"] or 1,
        routed_scaling_factor=float(hf["routed_scaling_factor"]),
        aux_loss_coef=balance,
    )


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
        "n_shared_experts": config.n_shared_expert,
        "first_k_dense_replace": config.first_dense_layers if config.n_expert else config.n_layer,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "routed_scaling_factor": config.routed_scaling_factor,
        "norm_topk_prob": config.norm_topk_prob,
        "num_nextn_predict_layers": 0,
    }
