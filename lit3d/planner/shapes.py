"""The model's parameter shapes from its `GPTConfig` alone, without torch: what the planner counts with.

`parameter_shapes` is, name for name and in the same order, ``Transformer(config).named_parameters()``
(`lit3d.models.transformer`, `lit3d.models.moe`), and `block_costs` what
`lit3d.strategies.pipelining.chunks.block_costs` measures on that module (the pipeline cut's costs). Building the real
model, even on the meta device, needs torch and costs seconds that ``lit3d plan`` should not pay.

NOTE: this is a second description of the model's shapes. tests/test_planner_shapes.py compares both functions with
the meta model for every preset and the tests' small models, so a change to the model that is not made here fails
the suite; ``lit3d plan --verify`` compares the planner with the really parallelised model.
"""

from __future__ import annotations

import math

from lit3d.models.config import GPTConfig

Shape = tuple[int, ...]


def parameter_shapes(config: GPTConfig) -> list[tuple[str, Shape]]:
    """``(name, shape)`` of every parameter, as ``Transformer(config).named_parameters()`` lists them (a tied head
    is the embedding's tensor, listed once)."""
    shapes = []
    for part, params in _parts(config):
        if part == "head" and config.tie_embeddings:
            continue
        shapes += [(f"{part}.{name}", shape) for name, shape in params]
    return shapes


def block_costs(config: GPTConfig) -> tuple[list[float], float, float]:
    """Parameter elements of each block, of the parts before the blocks (embedding) and of those after them (final
    norm and head, the head counted even when tied): the pipeline cut's costs, as the strategy measures them."""
    costs, before, after, seen_blocks = [], 0.0, 0.0, False
    for part, params in _parts(config):
        numel = float(sum(math.prod(shape) for _, shape in params))
        if part.startswith("blocks."):
            costs.append(numel)
            seen_blocks = True
        elif seen_blocks:
            after += numel
        else:
            before += numel
    return costs, before, after


def _parts(config: GPTConfig) -> list[tuple[str, list[tuple[str, Shape]]]]:
    """The network's top-level parts in registration order (each block its own part), with their parameters."""
    vocab, d = config.padded_vocab_size, config.d_model
    blocks = [(f"blocks.{i}", _block(config, i)) for i in range(config.n_layer)]
    ends = [("norm", [("weight", (d,))]), ("head", [("weight", (vocab, d))])]
    depths = [(f"mtp.{k}", _prediction_depth(config, k)) for k in range(config.num_nextn_predict_layers)]
    return [("embed", [("weight", (vocab, d))]), *blocks, *ends, *depths]


def _prediction_depth(config: GPTConfig, k: int) -> list[tuple[str, Shape]]:
    """`lit3d.models.mtp.MultiTokenPrediction` ``k`` (from 0): its two norms, ``eh_proj``, a block numbered after the
    decoder's (an MoE block in an MoE model) and its norm."""
    d = config.d_model
    block = [(f"block.{name}", shape) for name, shape in _block(config, config.n_layer + k)]
    return [
        ("enorm.weight", (d,)),
        ("hnorm.weight", (d,)),
        ("eh_proj.weight", (d, 2 * d)),
        *block,
        ("norm.weight", (d,)),
    ]


def _block(config: GPTConfig, index: int) -> list[tuple[str, Shape]]:
    """`lit3d.models.transformer.Block`: norm, attention, norm, then a gated MLP or (`is_moe_layer`) an MoE, and Gemma's
    norms after them (``sandwich_norm``)."""
    d, q_width, kv_width = config.d_model, config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    attention = [("q_proj", (q_width, d)), ("k_proj", (kv_width, d)), ("v_proj", (kv_width, d))]
    attention.append(("o_proj", (d, q_width)))
    shapes = [("attn_norm.weight", (d,))]
    if config.kv_lora_rank is not None:
        shapes += [(f"attn.{name}", shape) for name, shape in _latent_attention(config)]
        attention = []
    for name, shape in attention:  # (Qwen2's q, k and v biases after their weights, as nn.Linear registers them)
        biased = config.attention_bias or (config.qkv_bias and name != "o_proj")  # (gpt-oss: o_proj's too)
        shapes += [(f"attn.{name}.weight", shape)] + ([(f"attn.{name}.bias", shape[:1])] if biased else [])
    if config.qk_norm:
        shapes += [("attn.q_norm.weight", (config.head_dim,)), ("attn.k_norm.weight", (config.head_dim,))]
    if config.attention_sinks:
        shapes.append(("attn.sinks.weight", (config.n_head,)))
    shapes.append(("mlp_norm.weight", (d,)))
    post = [("post_attn_norm.weight", (d,)), ("post_mlp_norm.weight", (d,))] if config.sandwich_norm else []
    if not config.is_moe_layer(index):
        return shapes + [(f"mlp.{name}", shape) for name, shape in _mlp(d, config.d_ff, config.mlp_bias)] + post
    experts, width, biased = config.n_expert, config.d_ff_expert, config.mlp_bias
    shapes += [("mlp.router.gate.weight", (experts, d))] + ([("mlp.router.gate.bias", (experts,))] if biased else [])
    shapes += [(f"mlp.experts.{name}", (experts, d, width)) for name in ("gate_proj", "up_proj")]
    shapes += [("mlp.experts.down_proj", (experts, width, d))]
    if biased:  # gpt-oss's experts' biases, registered after the three weights
        shapes += [(f"mlp.experts.{name}_bias", (experts, width)) for name in ("gate_proj", "up_proj")]
        shapes += [("mlp.experts.down_proj_bias", (experts, d))]
    if config.n_shared_experts:
        shapes += [(f"mlp.shared.{name}", shape) for name, shape in _mlp(d, config.n_shared_experts * width, biased)]
    return shapes + post


def _latent_attention(config: GPTConfig) -> list[tuple[str, Shape]]:
    """`lit3d.models.latent_attention.LatentAttention` (DeepSeek's MLA): queries through ``q_proj``, or the low-rank
    ``q_a_proj`` → norm → ``q_b_proj``; keys and values from one latent (``kv_a_proj_with_mqa``, its norm,
    ``kv_b_proj``); ``o_proj`` from the value heads."""
    d, heads, rank, latent = config.d_model, config.n_head, config.q_lora_rank, config.kv_lora_rank
    q_width = heads * config.head_dim
    if rank is None:
        shapes = [("q_proj.weight", (q_width, d))]
    else:
        shapes = [
            ("q_a_proj.weight", (rank, d)),
            ("q_a_layernorm.weight", (rank,)),
            ("q_b_proj.weight", (q_width, rank)),
        ]
    return shapes + [
        ("kv_a_proj_with_mqa.weight", (latent + config.qk_rope_head_dim, d)),
        ("kv_a_layernorm.weight", (latent,)),
        ("kv_b_proj.weight", (heads * (config.qk_nope_head_dim + config.v_head_dim), latent)),
        ("o_proj.weight", (d, heads * config.v_head_dim)),
    ]


def _mlp(d: int, hidden: int, biased: bool = False) -> list[tuple[str, Shape]]:
    """`lit3d.models.mlp.MLP`: ``nn.Linear`` weights are ``[out, in]``, each followed by its bias where ``biased``."""
    shapes = []
    for name, shape in (("gate_proj", (hidden, d)), ("up_proj", (hidden, d)), ("down_proj", (d, hidden))):
        shapes += [(f"{name}.weight", shape)] + ([(f"{name}.bias", shape[:1])] if biased else [])
    return shapes


def linear_widths(config: GPTConfig) -> dict[str, tuple[int, int]]:
    """(inputs, outputs) of each linear a LoRA role names (`lit3d.models.lora_settings.ROLES`), whole: the attention's
    (latent attention's under ``kv_lora_rank``) and the dense MLP's. Tensor parallelism splits the outputs of ``q``,
    ``k``, ``v``, ``q_b``, ``kv_b``, ``gate`` and ``up`` and the inputs of ``o`` and ``down``; ``q_a`` and ``kv_a`` are
    whole on every rank."""
    d, f, q = config.d_model, config.d_ff, config.n_head * config.head_dim
    kv = config.n_kv_head * config.head_dim
    widths = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, f), "up": (d, f), "down": (f, d)}
    if config.kv_lora_rank is not None:
        latent, q_rank = config.kv_lora_rank, config.q_lora_rank or 0
        widths["q_a"], widths["q_b"] = (d, q_rank), (q_rank, q)
        widths["kv_a"] = (d, latent + config.qk_rope_head_dim)
        widths["kv_b"] = (latent, config.n_head * (config.qk_nope_head_dim + config.v_head_dim))
        widths["o"] = (config.n_head * config.v_head_dim, d)
    return widths


TP_SPLITS_INPUTS = frozenset({"o", "down"})  # row-parallel: the other roles split their outputs, but for
TP_WHOLE = frozenset({"q_a", "kv_a"})  # latent attention's down-projections, whole on every TP rank
