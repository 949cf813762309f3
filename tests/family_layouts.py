"""Tiny models of each family lit3d imports (`lit3d.models.config.FAMILIES`), trained at TP2, PP2 and, for Qwen2's
biases (the only tensors TP splits along their one dim, so ZeRO-1 slices each rank's part again), DP2×TP2 at ZeRO-1 and
ZeRO-3, and resumed from ZeRO-1 at TP2×PP2. Llama 3.2's tied head cannot be pipelined (refused by name), so it
trains at DP2 ZeRO-3 instead of PP2. Mistral's blocks are Llama's: the plain layouts of `LAYOUTS` are its."""

from layouts import HALF, saved_at_half

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}  # fmt: skip
SMALL = dict(n_layer=4, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=257, max_seq_len=32)
FAMILY_CONFIGS = {
    # Llama 3.2: llama3 rotary scaling, the head tied to the embedding (both split by vocabulary under TP)
    "llama3.2": dict(SMALL, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, tie_embeddings=True),
    "qwen2": dict(SMALL, rope_theta=1e6, qkv_bias=True, family="qwen2"),
    "qwen3": dict(SMALL, head_dim=16, qk_norm=True, family="qwen3"),
    "qwen3_moe": dict(SMALL, head_dim=16, qk_norm=True, family="qwen3_moe", n_expert=4, n_expert_per_token=2,
                      d_ff_expert=16, norm_topk_prob=False),
}  # fmt: skip


def _layouts() -> dict[str, tuple[int, dict]]:
    tp2, pp2 = {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2, "pipeline_schedule": "1f1b"}
    layouts = {}
    for family, config in FAMILY_CONFIGS.items():
        model = {"model": {"config": config}}
        layouts[f"{family}_tp2"] = (2, {**model, "strategy": tp2})
        if config.get("tie_embeddings"):  # a tied head is refused under PP (it lives on the embedding's stage)
            layouts[f"{family}_dp2_zero3"] = (2, {**model, "strategy": {"zero_stage": 3}})
        else:
            layouts[f"{family}_pp2"] = (2, {**model, "strategy": pp2})
    qwen2 = {"model": {"config": FAMILY_CONFIGS["qwen2"]}}
    layouts["qwen2_dp2_tp2_zero1"] = (4, {**qwen2, "strategy": {**tp2, "zero_stage": 1}, "checkpoint_every": HALF})
    layouts["qwen2_dp2_tp2_zero3"] = (4, {**qwen2, "strategy": {**tp2, "zero_stage": 3}})
    resumed = {**qwen2, "strategy": {**tp2, **pp2}, "ckpt_path": saved_at_half("qwen2_dp2_tp2_zero1")}
    layouts["qwen2_tp2_pp2_resumed_from_dp2_tp2_zero1"] = (4, resumed)
    return layouts


FAMILY_LAYOUTS = _layouts()
