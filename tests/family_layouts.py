"""Tiny models of each family lit3d imports (`lit3d.models.config.FAMILIES`), trained at TP2, at PP2 where their stages
differ from Llama's (`PIPELINED`) and, for Qwen2's biases (the only tensors TP splits along their one dim, so ZeRO-1
slices each rank's part again), DP2×TP2 at ZeRO-1, resumed from there at TP2×PP2. Llama 3.2's tied head cannot be
pipelined (refused by name), so it trains at DP2 ZeRO-3 instead of PP2. DeepSeek-V3 (multi-token prediction on the last
stage, the embeddings of its tokens ahead handed on from the first) also trains at DP2 ZeRO-3 with full recompute, CP2,
EP2, PP2 with the V-shaped zero-bubble schedule (4 blocks), CP2×TP2 with sequence parallelism and DP2×PP2 with EP2, and
resumed at TP2 with sequence parallelism from EP2. gpt-oss (windows and sinks, on packed documents) trains at TP2, PP2,
EP2 and DP2 ZeRO-3; Gemma 3 (tied, so not pipelined) at TP2, TP2 with sequence parallelism and DP2 ZeRO-3. Mistral's
blocks are Llama's: the plain layouts of `LAYOUTS` are its."""

import lightning as L
from layouts import HALF, saved_at_half

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}  # fmt: skip
# YaRN as DeepSeek-V3 stretches its context (4x here, with the softmax temperature of mscale_all_dim).
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}  # fmt: skip
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False}  # fmt: skip
SMALL = dict(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=257, max_seq_len=32)
FAMILY_CONFIGS = {
    # Llama 3.2: llama3 rotary scaling, the head tied to the embedding (both split by vocabulary under TP)
    "llama3.2": dict(SMALL, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, tie_embeddings=True),
    "qwen2": dict(SMALL, rope_theta=1e6, qkv_bias=True, family="qwen2"),
    "qwen3": dict(SMALL, head_dim=16, qk_norm=True, family="qwen3"),
    "qwen3_moe": dict(SMALL, head_dim=16, qk_norm=True, family="qwen3_moe", n_expert=4, n_expert_per_token=2,
                      d_ff_expert=16, norm_topk_prob=False),
    # DeepSeek-V3: latent attention with low-rank queries, value heads narrower than the query and key heads and
    # interleaved rotary under YaRN; 8 routed experts, 2 per token from the best of 2 groups, a shared expert, a dense
    # first block, the sigmoid router's balancing bias moving every step, routed_scaling_factor; one MTP depth
    "deepseek_v3": dict(SMALL, n_kv_head=4, family="deepseek_v3", kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=12, rope_interleave=True, rope_scaling=DEEPSEEK_YARN,
                        n_expert=8, n_expert_per_token=2, n_group=2, topk_group=1, n_shared_experts=1, d_ff_expert=16,
                        first_dense_layers=1, router="sigmoid", routed_scaling_factor=2.5,
                        num_nextn_predict_layers=1),
    # gpt-oss: windows of 8 tokens in the first block (shorter than the 32-token rows it trains on, packed with
    # documents that the windows must not cross), a sink per head, biased attention, a biased router over experts with
    # biases and the clamped SwiGLU, YaRN
    "gpt_oss": dict(SMALL, head_dim=16, family="gpt_oss", n_expert=4, n_expert_per_token=2, d_ff_expert=64,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention"], attention_sinks=True,
                    attention_bias=True, mlp_bias=True, swiglu_limit=7.0, rope_scaling=GPT_OSS_YARN),
    # Gemma 3: a windowed block (rotary base 10k), then a full one (1M, stretched 8x), four norms per block scaling by
    # 1 + weight, per-head q/k norms, GeGLU, scaled and tied embeddings, query_pre_attn_scalar, soft-capped logits
    "gemma3_text": dict(SMALL, head_dim=16, family="gemma3_text", qk_norm=True, sandwich_norm=True,
                        norm_unit_offset=True, scale_embeddings=True, hidden_act="gelu_pytorch_tanh",
                        query_pre_attn_scalar=12, rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
                        rope_local_base_freq=1e4, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                        tie_embeddings=True, final_logit_softcapping=30.0),
}  # fmt: skip
# DeepSeek-V3's V (4 stages over 2 ranks, a block each) trains 4 blocks, against that model's own single process
DEEPSEEK_DEEP = dict(FAMILY_CONFIGS["deepseek_v3"], n_layer=4)
# Families whose stages differ from Llama's (multi-token prediction on the last; windows by layer type): trained at
# PP2. Qwen's blocks differ inside attention and the MLP only, which TP2 splits; PP splits them as Llama's.
PIPELINED = ("deepseek_v3", "gpt_oss")
# gpt-oss trains on rows of 32 tokens packed with short documents (`conftest.packed_data`): its windows inside them
PACKED_32 = {"data": {"document_masking": True, "seq_len": 32}}


class RouterBiases(L.Callback):
    """Records, after the fit, the balancing bias of every sigmoid router this rank holds, by block."""

    def __init__(self) -> None:
        self.biases: dict[str, list[float]] = {}

    def on_train_end(self, trainer, pl_module) -> None:
        self.biases = {str(layer.index): layer.router.expert_bias.tolist() for layer in pl_module.model.moe_layers()}

    def results(self) -> dict:
        return {"router_biases": self.biases}


def family_job(family: str, config: dict | None = None) -> dict:
    """The job overrides of ``family``'s tiny model (or ``config``, a variant of it; its single-process run's too):
    DeepSeek-V3's record the router biases (`RouterBiases`)."""
    job = {"model": {"config": config or FAMILY_CONFIGS[family]}}
    if family == "gpt_oss":
        return {**job, **PACKED_32}
    return {**job, "callbacks": [RouterBiases()]} if family == "deepseek_v3" else job


def _layouts() -> dict[str, tuple[int, dict]]:
    tp2, pp2 = {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2, "pipeline_schedule": "1f1b"}
    layouts = {}
    for family, config in FAMILY_CONFIGS.items():
        job = family_job(family)
        layouts[f"{family}_tp2"] = (2, {**job, "strategy": tp2})
        if config.get("tie_embeddings"):  # a tied head is refused under PP (it lives on the embedding's stage)
            layouts[f"{family}_dp2_zero3"] = (2, {**job, "strategy": {"zero_stage": 3}})
        elif family in PIPELINED:
            layouts[f"{family}_pp2"] = (2, {**job, "strategy": pp2})
    qwen2 = {"model": {"config": FAMILY_CONFIGS["qwen2"]}}
    layouts["qwen2_dp2_tp2_zero1"] = (4, {**qwen2, "strategy": {**tp2, "zero_stage": 1}, "checkpoint_at": HALF})
    resumed = {**qwen2, "strategy": {**tp2, **pp2}, "ckpt_path": saved_at_half("qwen2_dp2_tp2_zero1")}
    layouts["qwen2_tp2_pp2_resumed_from_dp2_tp2_zero1"] = (4, resumed)
    sp = {**tp2, "sequence_parallel": True}
    windowed = {
        "gpt_oss_ep2": (2, {**family_job("gpt_oss"), "strategy": {"expert_parallel_size": 2}}),
        "gpt_oss_dp2_zero3": (2, {**family_job("gpt_oss"), "strategy": {"zero_stage": 3}}),
        "gemma3_text_tp2_sequence_parallel": (2, {**family_job("gemma3_text"), "strategy": sp}),
        # the ring attention with windows, sinks (gpt-oss, on packed documents) and Gemma's own score scale
        "gpt_oss_cp2": (2, {**family_job("gpt_oss"), "strategy": {"context_parallel_size": 2}}),
        "gemma3_text_cp2": (2, {**family_job("gemma3_text"), "strategy": {"context_parallel_size": 2}}),
    }
    return layouts | windowed | _deepseek_layouts()


def _deepseek_layouts() -> dict[str, tuple[int, dict]]:
    """DeepSeek-V3's besides TP2 and PP2: its weights sharded over DP ranks (and recomputed in backward), its
    sequences (16 tokens) over CP ranks (latent attention in the ring, each depth's tokens ahead cut from the whole
    rows), its experts over EP ranks, its stages in a V (the last stage, with the depths, on the first's rank), CP
    with TP and SP, PP with EP (and DP), and EP2's checkpoint of step `HALF` resumed at TP2 with SP."""
    sp = {"tensor_parallel_size": 2, "sequence_parallel": True}
    recomputed = {"zero_stage": 3, "activation_checkpointing": "full"}
    resumed = {"strategy": sp, "ckpt_path": saved_at_half("deepseek_v3_ep2")}
    pp2 = {"pipeline_parallel_size": 2, "pipeline_schedule": "1f1b"}
    layouts = {
        # (recomputed in backward, each MoE block must route as in forward: the biases move after backward)
        "deepseek_v3_dp2_zero3_full_recompute": (2, {"strategy": recomputed}),
        "deepseek_v3_cp2": (2, {"strategy": {"context_parallel_size": 2}}),
        "deepseek_v3_ep2": (2, {"strategy": {"expert_parallel_size": 2}, "checkpoint_at": HALF}),
        "deepseek_v3_tp2_sequence_parallel_resumed_from_ep2": (2, resumed),
        "deepseek_v3_pp2_zbv": (
            2,
            {"strategy": {**pp2, "pipeline_schedule": "zbv"}, "model": {"config": DEEPSEEK_DEEP}},
        ),
        "deepseek_v3_cp2_tp2_sequence_parallel": (4, {"strategy": {**sp, "context_parallel_size": 2}}),
        "deepseek_v3_dp2_pp2_ep2": (4, {"strategy": {**pp2, "expert_parallel_size": 2}}),
    }
    return {name: (world, {**family_job("deepseek_v3"), **job}) for name, (world, job) in layouts.items()}


FAMILY_LAYOUTS = _layouts()


def reference_jobs() -> dict[str, dict]:
    """The single-process runs the layouts follow (`reference_of`): each family's, and the 4-block DeepSeek-V3's."""
    return {
        **{name: family_job(name) for name in FAMILY_CONFIGS},
        "deepseek_v3_deep": family_job("deepseek_v3", DEEPSEEK_DEEP),
    }


def reference_of(layout: str) -> str:
    """The name in `reference_jobs` of the single-process run ``layout`` follows."""
    if FAMILY_LAYOUTS[layout][1]["model"]["config"] is DEEPSEEK_DEEP:
        return "deepseek_v3_deep"
    return max((name for name in FAMILY_CONFIGS if layout.startswith(f"{name}_")), key=len)  # qwen3_moe, not qwen3
