"""What a grouped-query block keeps for backward beyond Llama's, per token: heads wider than ``d_model / n_head``, the
per-head q/k norms (Qwen3, Gemma 3), gpt-oss's sinks and clamped SwiGLU, Gemma's norms after attention and the MLP and
its soft-capped logits. `lit3d.planner.memory` adds these up; tests/test_activation_memory.py holds them to what
autograd saves."""

from __future__ import annotations

from lit3d.models.config import GPTConfig

SINK_WIDTH = 8  # the coordinates `lit3d.models.attention.masked_attention` adds to each head for the sink


def attention_bytes_per_token(config: GPTConfig, a: int, repeated: float = 0.0) -> float:
    """Grouped-query attention's saved tensors per token (``a``: bytes per element of the compute dtype): rotated q,
    k and v and the output as SDPA keeps them, the output's copy the output projection reads, the fp32 log-sum-exp;
    each head ``SINK_WIDTH`` wider with sinks; the q/k norms' fp32 input, normalised input and 1/rms. ``repeated``:
    the share of blocks whose K and V are kept once per query head (`repeated_kv_share`)."""
    q, kv, heads, kv_heads = config.n_head * config.head_dim, config.n_kv_head * config.head_dim, config.n_head, 0
    kv = kv + repeated * (q - kv)
    attention = a * ((q + 2 * kv) + q) + 4 * heads
    if config.attention_sinks:
        widen = (config.head_dim + SINK_WIDTH) / config.head_dim
        attention = a * ((q + 2 * kv) * widen + q * widen + q) + 4 * heads
    if config.qk_norm:
        kv_heads = config.n_kv_head
        attention += 4 * (2 * (q + kv) + heads + kv_heads)
    return attention


def norms_per_block(config: GPTConfig) -> int:
    """A block's RMSNorms on the residual stream: 2, or 4 with Gemma's after attention and the MLP."""
    return 4 if config.sandwich_norm else 2


def gated_tensors(config: GPTConfig) -> int:
    """What a gated MLP keeps per hidden unit: gate, up, act(gate) and the product (4); gpt-oss's clamped SwiGLU its
    gate and up before the clamps, the clamped gate, its sigmoid, their product, ``up + 1`` and the result (7)."""
    return 7 if config.swiglu_limit is not None else 4


def expert_bias_bytes_per_token(config: GPTConfig) -> float:
    """Biased experts (gpt-oss) keep, per projection, the int64 index that spreads each expert's bias over its rows."""
    return 3 * 8 * config.n_expert_per_token if config.mlp_bias else 0.0


def softcap_bytes_per_token(config: GPTConfig, tp: int, a: int) -> float:
    """Soft-capped logits keep their ``tanh`` (vocabulary-split under TP) for backward."""
    return config.padded_vocab_size / tp * a if config.final_logit_softcapping is not None else 0.0


def repeated_kv_share(config: GPTConfig, on_gpu: bool, documents: bool) -> float:
    """The share of blocks whose attention keeps K and V once per query head: on a GPU, the masked kernel (SDPA's
    memory-efficient one, for windows without flash-attn, sinks and packed documents) takes no grouped heads, so
    `lit3d.models.attention.masked_attention` repeats them first; none on a CPU, whose kernel takes them."""
    if not on_gpu or config.n_head == config.n_kv_head or config.kv_lora_rank is not None:
        return 0.0
    if documents or config.attention_sinks:
        return 1.0
    return sum(config.window(index) is not None for index in range(config.n_layer)) / config.n_layer
