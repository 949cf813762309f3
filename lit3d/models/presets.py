"""The named model shapes `GPTConfig.from_name` knows: published Llama, Qwen, Mistral and DeepSeek-V3-shaped models
(their parameter counts are checked against the published ones in tests/test_config.py) and small ones to try layouts
with. Plain field dicts, so that this module imports nothing."""

from __future__ import annotations

from typing import Any

# Llama 3.1's rotary scaling to 128k positions (3.2 has a factor of 32).
LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _yarn(factor: float) -> dict[str, Any]:
    """DeepSeek-V3's YaRN scaling of its 4,096 trained positions by ``factor`` (as its config.json writes it)."""
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }


def _gpt_oss(layers: int, experts: int) -> dict[str, Any]:
    """gpt-oss's published config.json: windows of 128 tokens in every other block (the first windowed), a sink per
    head, biased attention, experts with biases and a clamped SwiGLU, YaRN to 128k positions."""
    yarn = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False}  # fmt: skip
    return dict(
        n_layer=layers, n_head=64, n_kv_head=8, head_dim=64, d_model=2880, d_ff=2880, vocab_size=201088,
        max_seq_len=131072, rope_theta=150000.0, rope_scaling=yarn, norm_eps=1e-5, family="gpt_oss",
        n_expert=experts, n_expert_per_token=4, d_ff_expert=2880, aux_loss_coef=0.9, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2), attention_sinks=True,
        attention_bias=True, mlp_bias=True, swiglu_limit=7.0,
    )  # fmt: skip


def _gemma3(layers: int, d_model: int, d_ff: int, heads: int, head_dim: int, scalar: int, **more: Any) -> dict:
    """Gemma 3's text model as its published config.json has it: five windowed blocks (their own rotary base) to one
    full, norms around attention and the MLP scaling by 1 + weight, per-head q/k norms, GeGLU, scaled and tied
    embeddings of a 262k vocabulary; the 4B, 12B and 27B stretch the full blocks' rotary 8x (linear) to 128k."""
    fields = dict(
        n_layer=layers, n_head=heads, n_kv_head=heads // 2, head_dim=head_dim, d_model=d_model, d_ff=d_ff,
        vocab_size=262208, max_seq_len=131072, rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_local_base_freq=10000.0, norm_eps=1e-6, family="gemma3_text", sliding_window=1024,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        qk_norm=True, sandwich_norm=True, norm_unit_offset=True, scale_embeddings=True,
        hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=scalar, tie_embeddings=True,
    )  # fmt: skip
    return fields | more


# Llama-style presets. `gpt3-175b` keeps GPT-3's widths and parameter count with a SwiGLU MLP (3 matrices of
# d_ff = 2/3 * 4 * d_model hold as many weights as GPT-3's 2 matrices of 4 * d_model), with an untied head so
# that it can be pipelined.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=4, n_head=4, n_kv_head=2, d_model=128, d_ff=384, vocab_size=256, max_seq_len=256),
    "125m": dict(n_layer=12, n_head=12, n_kv_head=12, d_model=768, d_ff=2048, vocab_size=32000, max_seq_len=2048),
    "1b": dict(
        n_layer=16,
        n_head=32,
        n_kv_head=8,
        d_model=2048,
        d_ff=8192,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    "llama-8b": dict(
        n_layer=32,
        n_head=32,
        n_kv_head=8,
        d_model=4096,
        d_ff=14336,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama-70b": dict(
        n_layer=80,
        n_head=64,
        n_kv_head=8,
        d_model=8192,
        d_ff=28672,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama-405b": dict(
        n_layer=126,
        n_head=128,
        n_kv_head=8,
        d_model=16384,
        d_ff=53248,
        vocab_size=128256,
        max_seq_len=131072,  # Llama 3.1: 128k tokens after the long-context stage (trained at TP8 x CP16 x PP16)
        rope_theta=500000.0,
    ),
    # Llama 3.1 and 3.2 as their published config.json files have them: 128k positions by llama3 rotary scaling.
    "llama3.1-8b": dict(
        n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336, vocab_size=128256, max_seq_len=131072,
        rope_theta=500000.0, norm_eps=1e-5, rope_scaling=dict(LLAMA31_SCALING),
    ),
    "llama3.1-70b": dict(
        n_layer=80, n_head=64, n_kv_head=8, d_model=8192, d_ff=28672, vocab_size=128256, max_seq_len=131072,
        rope_theta=500000.0, norm_eps=1e-5, rope_scaling=dict(LLAMA31_SCALING),
    ),
    "llama3.2-1b": dict(
        n_layer=16, n_head=32, n_kv_head=8, d_model=2048, d_ff=8192, vocab_size=128256, max_seq_len=131072,
        rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True, rope_scaling=dict(LLAMA31_SCALING, factor=32.0),
    ),
    "llama3.2-3b": dict(
        n_layer=28, n_head=24, n_kv_head=8, d_model=3072, d_ff=8192, vocab_size=128256, max_seq_len=131072,
        rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True, rope_scaling=dict(LLAMA31_SCALING, factor=32.0),
    ),
    "qwen2.5-7b": dict(
        n_layer=28, n_head=28, n_kv_head=4, d_model=3584, d_ff=18944, vocab_size=152064, max_seq_len=32768,
        rope_theta=1e6, norm_eps=1e-6, qkv_bias=True, family="qwen2",
    ),
    "qwen3-8b": dict(
        n_layer=36, n_head=32, n_kv_head=8, head_dim=128, d_model=4096, d_ff=12288, vocab_size=151936,
        max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, qk_norm=True, family="qwen3",
    ),
    "qwen3-32b": dict(
        n_layer=64, n_head=64, n_kv_head=8, head_dim=128, d_model=5120, d_ff=25600, vocab_size=151936,
        max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, qk_norm=True, family="qwen3",
    ),
    "mistral-7b": dict(  # v0.3
        n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336, vocab_size=32768, max_seq_len=32768,
        rope_theta=1e6, family="mistral",
    ),
    "gpt3-175b": dict(
        n_layer=96, n_head=96, n_kv_head=96, d_model=12288, d_ff=32768, vocab_size=50257, max_seq_len=2048
    ),
    # Mixture-of-Experts, from the models' published config.json files.
    "moe-tiny": dict(
        n_layer=4, n_head=4, n_kv_head=2, d_model=128, d_ff=384, vocab_size=256, max_seq_len=256,
        n_expert=8, n_expert_per_token=2, d_ff_expert=128, first_dense_layers=1,
    ),
    "mixtral-8x7b": dict(
        n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336, vocab_size=32000, max_seq_len=32768,
        rope_theta=1e6, n_expert=8, n_expert_per_token=2,
    ),
    "mixtral-8x22b": dict(
        n_layer=56, n_head=48, n_kv_head=8, d_model=6144, d_ff=16384, vocab_size=32768, max_seq_len=65536,
        rope_theta=1e6, n_expert=8, n_expert_per_token=2,
    ),
    "qwen3-30b-a3b": dict(
        n_layer=48, n_head=32, n_kv_head=4, head_dim=128, d_model=2048, d_ff=6144, vocab_size=151936,
        max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, n_expert=128, n_expert_per_token=8, d_ff_expert=768,
        aux_loss_coef=0.001, qk_norm=True, family="qwen3_moe",
    ),
    "qwen3-235b-a22b": dict(
        n_layer=94, n_head=64, n_kv_head=4, head_dim=128, d_model=4096, d_ff=12288, vocab_size=151936,
        max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, n_expert=128, n_expert_per_token=8, d_ff_expert=1536,
        aux_loss_coef=0.001, qk_norm=True, family="qwen3_moe",
    ),
    # DeepSeek-V3's architecture (multi-head latent attention, a sigmoid router over fine-grained experts with shared
    # ones, dense first blocks), from the published config.json files; DeepSeek-V3 with its one MTP depth.
    "deepseek-v3": dict(
        n_layer=61, n_head=128, n_kv_head=128, d_model=7168, d_ff=18432, vocab_size=129280, max_seq_len=163840,
        rope_scaling=_yarn(40.0), norm_eps=1e-6, family="deepseek_v3", n_expert=256, n_expert_per_token=8,
        n_shared_experts=1, d_ff_expert=2048, first_dense_layers=3, router="sigmoid", kv_lora_rank=512,
        q_lora_rank=1536, n_group=8, topk_group=4, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
    ),
    "kimi-k2": dict(
        n_layer=61, n_head=64, n_kv_head=64, d_model=7168, d_ff=18432, vocab_size=163840, max_seq_len=131072,
        rope_theta=50000.0, rope_scaling=_yarn(32.0), norm_eps=1e-6, family="deepseek_v3", n_expert=384,
        n_expert_per_token=8, n_shared_experts=1, d_ff_expert=2048, first_dense_layers=1, router="sigmoid",
        kv_lora_rank=512, q_lora_rank=1536, routed_scaling_factor=2.827,
    ),
    "moonlight-16b-a3b": dict(
        n_layer=27, n_head=16, n_kv_head=16, d_model=2048, d_ff=11264, vocab_size=163840, max_seq_len=8192,
        rope_theta=50000.0, norm_eps=1e-5, family="deepseek_v3", n_expert=64, n_expert_per_token=6,
        n_shared_experts=2, d_ff_expert=1408, first_dense_layers=1, router="sigmoid", kv_lora_rank=512,
        routed_scaling_factor=2.446,
    ),
    # gpt-oss and Gemma 3 (text), from their published config.json files.
    "gpt-oss-20b": _gpt_oss(layers=24, experts=32),
    "gpt-oss-120b": _gpt_oss(layers=36, experts=128),
    "gemma-3-1b": _gemma3(26, 1152, 6912, heads=4, head_dim=256, scalar=256, n_kv_head=1, vocab_size=262144,
                          max_seq_len=32768, rope_scaling=None, sliding_window=512),
    "gemma-3-4b": _gemma3(34, 2560, 10240, heads=8, head_dim=256, scalar=256),
    "gemma-3-12b": _gemma3(48, 3840, 15360, heads=16, head_dim=256, scalar=256),
    "gemma-3-27b": _gemma3(62, 5376, 21504, heads=32, head_dim=128, scalar=168),
}  # fmt: skip
