"""The decoder's tensor-parallel plan, as data: which module (by name pattern) plays which role.

The strategy turns each role into a DTensor parallel style (`lit3d.strategies.split.tensor_parallel`); the planner
counts each tensor's shards with the same plan (`lit3d.planner.tensors`), so this module imports no torch.
"""

from __future__ import annotations

from lit3d.models.config import GPTConfig

# Which module does what under tensor parallelism, by name pattern. The strategy turns each role into a DTensor
# parallel style (Megatron pattern: column-parallel in, row-parallel out, one all-reduce per region forward).
#   colwise / rowwise  split the output / input features of a linear
#   tp_region          a module that runs on the full sequence (its input is gathered under sequence parallel)
#   norm               runs on sequence shards under sequence parallel, replicated otherwise
#   residual_norm      the same, for a norm whose output is added to the residual stream (Gemma's post-norms)
#   head_norm          a norm over each head (Qwen3's q and k norms): on each rank's heads, its weight replicated
#   head_split         a tensor with a value per query head (gpt-oss's attention sinks): split with the heads
#   replicated         a small module inside a region that every rank computes whole (latent attention's
#                      down-projections and their norms): its weights replicated, its input the region's
#   vocab_embedding    embedding rows split by vocabulary
#   vocab_head         LM head split by vocabulary; its logits stay sharded for the parallel loss
TENSOR_PARALLEL_PLAN: dict[str, str] = {
    "embed": "vocab_embedding",
    "blocks.*.attn_norm": "norm",
    "blocks.*.attn": "tp_region",
    "blocks.*.attn.q_proj": "colwise",
    "blocks.*.attn.k_proj": "colwise",
    "blocks.*.attn.v_proj": "colwise",
    "blocks.*.attn.o_proj": "rowwise",
    "blocks.*.mlp_norm": "norm",
    "blocks.*.mlp": "tp_region",
    "blocks.*.mlp.gate_proj": "colwise",
    "blocks.*.mlp.up_proj": "colwise",
    "blocks.*.mlp.down_proj": "rowwise",
    "norm": "norm",
    "head": "vocab_head",
}


def tensor_parallel_plan(config: GPTConfig) -> dict[str, str]:
    """`TENSOR_PARALLEL_PLAN` for ``config``: an MoE block's feed-forward is a ``replicated_region`` (every TP rank
    routes the same tokens through the same experts; expert parallelism is what splits the experts); Qwen3's q and k
    norms are ``head_norm``s (each rank normalises its heads; their weights' gradients are summed over TP); latent
    attention's projections are `latent_attention_plan`'s, and multi-token prediction's depths `multi_token_plan`'s."""
    base = dict(TENSOR_PARALLEL_PLAN)
    if config.kv_lora_rank is not None:
        base = {k: v for k, v in base.items() if k.split(".")[-1] not in ("q_proj", "k_proj", "v_proj")}
        base.update(latent_attention_plan(config))
    if config.qk_norm:
        base.update({"blocks.*.attn.q_norm": "head_norm", "blocks.*.attn.k_norm": "head_norm"})
    if config.attention_sinks:
        base["blocks.*.attn.sinks"] = "head_split"
    if config.sandwich_norm:  # Gemma's norms after attention and the MLP, on the residual stream's layout
        base.update({"blocks.*.post_attn_norm": "residual_norm", "blocks.*.post_mlp_norm": "residual_norm"})
    if config.n_expert:
        mlp = [k for k in TENSOR_PARALLEL_PLAN if k == "blocks.*.mlp" or k.startswith("blocks.*.mlp.")]
        plan = {k: v for k, v in base.items() if k not in mlp}
        for i in range(config.n_layer):
            if config.is_moe_layer(i):
                plan[f"blocks.{i}.mlp"] = "replicated_region"
            else:
                plan.update({k.replace("*", str(i)): TENSOR_PARALLEL_PLAN[k] for k in mlp})
        base = plan
    return base | (multi_token_plan(config, base) if config.num_nextn_predict_layers else {})


def multi_token_plan(config: GPTConfig, plan: dict[str, str]) -> dict[str, str]:
    """Multi-token prediction's depths (`lit3d.models.mtp`) under TP: each depth's block split as the decoder's blocks
    of its kind (MoE in an MoE model), its norms on sequence shards as the decoder's, and ``eh_proj`` whole on every
    rank over the whole sequence (a ``replicated_region``: one small matmul per token)."""
    block = {k.removeprefix("blocks.*."): v for k, v in plan.items() if k.startswith("blocks.*.")}
    if config.n_expert:  # (the decoder's MoE rules name its blocks one by one; every depth is an MoE block)
        block["mlp"] = "replicated_region"
    rules = {f"mtp.*.block.{name}": role for name, role in block.items()}
    rules |= {f"mtp.*.{name}": "norm" for name in ("enorm", "hnorm", "norm")}
    return rules | {"mtp.*.eh_proj": "replicated_region"}


def latent_attention_plan(config: GPTConfig) -> dict[str, str]:
    """Multi-head latent attention (`lit3d.models.latent_attention`) under TP: the per-head up-projections
    (``q_b_proj`` or ``q_proj``, ``kv_b_proj``) split by heads, ``o_proj`` by its input, the low-rank down-projections
    and their norms whole on every rank (each rank's heads read all of the latent)."""
    if config.q_lora_rank is None:
        split, whole = ("q_proj", "kv_b_proj"), ("kv_a_proj_with_mqa", "kv_a_layernorm")
    else:
        split, whole = ("q_b_proj", "kv_b_proj"), ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
    plan = {f"blocks.*.attn.{name}": "colwise" for name in split}
    return plan | {f"blocks.*.attn.{name}": "replicated" for name in whole}
