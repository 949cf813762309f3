"""The checks `lit3d.GPTConfig` runs on the settings that go together (experts and their routing, latent attention,
windows and sinks), each refusing what does not fit in one line that names the values. No torch."""

from __future__ import annotations

from typing import Any

# What a layer of ``layer_types`` attends to: the last ``sliding_window`` tokens, or the whole context before it.
LAYER_TYPES = ("sliding_attention", "full_attention")


def check_experts(config: Any) -> None:
    if config.d_ff_expert is None:
        config.d_ff_expert = config.d_ff
    if config.n_expert < 0 or config.n_shared_experts < 0 or config.d_ff_expert <= 0 or config.aux_loss_coef < 0:
        raise ValueError(
            f"n_expert={config.n_expert}, n_shared_experts={config.n_shared_experts}, d_ff_expert={config.d_ff_expert} "
            f"and aux_loss_coef={config.aux_loss_coef} must not be negative (d_ff_expert positive)"
        )
    if config.n_expert and not 1 <= config.n_expert_per_token <= config.n_expert:
        raise ValueError(
            f"n_expert_per_token={config.n_expert_per_token} must be between 1 and n_expert={config.n_expert}"
        )
    if not 0 <= config.first_dense_layers <= config.n_layer:
        raise ValueError(
            f"first_dense_layers={config.first_dense_layers} must be between 0 and n_layer={config.n_layer}"
        )
    if config.router not in ("softmax", "sigmoid"):
        raise ValueError(f"router={config.router!r} is not one of 'softmax', 'sigmoid'")
    if config.capacity_factor is not None and config.capacity_factor <= 0:
        raise ValueError(f"capacity_factor={config.capacity_factor} must be positive (or None: dropless)")
    if config.num_nextn_predict_layers < 0 or config.mtp_loss_weight < 0:
        raise ValueError(
            f"num_nextn_predict_layers={config.num_nextn_predict_layers} and mtp_loss_weight={config.mtp_loss_weight} "
            "must not be negative"
        )
    check_groups(config)


def check_groups(config: Any) -> None:
    """DeepSeek-V3's group-limited routing: groups of at least two experts (each scored by its best two), enough
    experts in the eligible groups, and only for the sigmoid router."""
    groups, chosen = config.n_group, config.topk_group
    if config.routed_scaling_factor <= 0 or groups < 1 or not 1 <= chosen <= groups:
        raise ValueError(
            f"n_group={groups}, topk_group={chosen}, routed_scaling_factor={config.routed_scaling_factor}: "
            "n_group and the scale must be positive and topk_group between 1 and n_group"
        )
    if groups == 1 or not config.n_expert:
        return
    per_group = config.n_expert // groups
    if config.router != "sigmoid" or config.n_expert % groups or per_group < 2:
        raise ValueError(
            f"n_group={groups} with router={config.router!r}, n_expert={config.n_expert}: groups are for the sigmoid "
            "router, and n_group must divide n_expert into groups of two experts or more"
        )
    if config.n_expert_per_token > chosen * per_group:
        raise ValueError(
            f"n_expert_per_token={config.n_expert_per_token} is more than the {chosen * per_group} experts of "
            f"topk_group={chosen} groups of {per_group}"
        )


def check_latent_attention(config: Any) -> None:
    """Multi-head latent attention's widths, and the settings of grouped-query attention it does not take; its
    q and k heads are ``qk_nope_head_dim + qk_rope_head_dim`` wide (``head_dim``)."""
    if config.kv_lora_rank is None:
        if config.q_lora_rank is not None or config.rope_interleave:
            raise ValueError(
                f"q_lora_rank={config.q_lora_rank}, rope_interleave={config.rope_interleave} are settings of "
                "multi-head latent attention: set kv_lora_rank too"
            )
        return
    names = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    widths = {name: getattr(config, name) for name in names}
    if any(width is not None and width <= 0 for width in widths.values()) or config.qk_rope_head_dim % 2:
        raise ValueError(f"{widths}: latent attention's widths must be positive, qk_rope_head_dim even")
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    if config.n_kv_head != config.n_head or config.qk_norm or config.qkv_bias or config.head_dim not in (None, qk):
        raise ValueError(
            f"n_kv_head={config.n_kv_head}, qk_norm={config.qk_norm}, qkv_bias={config.qkv_bias}, "
            f"head_dim={config.head_dim}: multi-head latent attention (kv_lora_rank={config.kv_lora_rank}) has "
            f"n_kv_head = n_head={config.n_head}, no q/k norms or biases, and heads of {qk} "
            "(qk_nope_head_dim + qk_rope_head_dim)"
        )
    config.head_dim = qk


def check_attention(config: Any) -> None:
    """Windows per layer (`GPTConfig.layer_types`), gpt-oss's clamped SwiGLU and Gemma's settings: values in range."""
    window, kinds = config.sliding_window, config.layer_types
    if window is not None and window < 1:
        raise ValueError(f"sliding_window={window} must be a positive number of tokens (or None: no window)")
    if kinds is not None:
        unknown = sorted({kind for kind in kinds if kind not in LAYER_TYPES})
        if len(kinds) != config.n_layer or unknown:
            raise ValueError(
                f"layer_types={kinds}: one of {', '.join(LAYER_TYPES)} per block (n_layer={config.n_layer}); "
                f"{unknown or len(kinds)} is not"
            )
        if window is None and "sliding_attention" in kinds:
            raise ValueError(f"layer_types={kinds} has windowed blocks: set sliding_window too")
    if config.hidden_act not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(f"hidden_act={config.hidden_act!r} is not one of 'silu', 'gelu_pytorch_tanh'")
    positive = {
        name: getattr(config, name)
        for name in ("swiglu_limit", "query_pre_attn_scalar", "rope_local_base_freq", "final_logit_softcapping")
    }
    wrong = {name: value for name, value in positive.items() if value is not None and value <= 0}
    if wrong:
        raise ValueError(f"{wrong}: must be positive (or None)")
    sinks, biased = config.attention_sinks, config.attention_bias
    if config.kv_lora_rank is not None and (window is not None or sinks or biased):
        raise ValueError(
            f"sliding_window={window}, attention_sinks={sinks}, attention_bias={biased}: "
            f"latent attention (kv_lora_rank={config.kv_lora_rank}) has no windows, sinks or biases in lit3d"
        )
