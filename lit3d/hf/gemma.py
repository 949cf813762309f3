"""Gemma 3's ``config.json`` (``gemma3_text``, the text model of every Gemma 3 size) as `GPTConfig` fields and back. No
torch: ``lit3d plan`` reads these.

Gemma 3's block normalises four times (``input_layernorm`` and ``post_attention_layernorm`` around attention,
``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` around the MLP: lit3d's ``attn_norm``,
``post_attn_norm``, ``mlp_norm`` and ``post_mlp_norm``), each RMSNorm scaling by ``1 + weight``; q and k are normalised
per head; the MLP is a GeGLU; the embeddings are scaled by √d; five windowed layers (their own rotary base) alternate
with one full one (``layer_types``). transformers 5 writes the two rotary settings under ``rope_parameters`` by layer
type; transformers 4 wrote ``rope_theta``, ``rope_scaling`` (the full layers') and ``rope_local_base_freq``.
"""

from __future__ import annotations

from typing import Any

from lit3d.models.config import GPTConfig

# lit3d's names of a Gemma block's norms (relative to the block) -> HuggingFace's (relative to its layer)
NORMS = {
    "attn_norm": "input_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
}


def gemma_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The `GPTConfig` fields of a ``gemma3_text`` ``config.json`` besides the common ones (the rotary ones included);
    refuses bidirectional attention, which lit3d's causal model does not compute."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True: lit3d's attention is causal (Gemma 3's default)")
    rope = hf.get("rope_parameters") or {}
    full, local = rope.get("full_attention"), rope.get("sliding_attention")
    if full is None:  # transformers 4's fields
        full = {"rope_theta": hf.get("rope_theta", 1e6), **(hf.get("rope_scaling") or {"rope_type": "default"})}
        local = {"rope_theta": hf.get("rope_local_base_freq", 1e4), "rope_type": "default"}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.sliding_attention={local}: lit3d's windowed layers take no rotary scaling")
    kind = full.get("rope_type", full.get("type", "default"))
    scaling = None if kind == "default" else {"rope_type": kind, "factor": full["factor"]}
    layers, pattern = hf["num_hidden_layers"], hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    kinds = hf.get("layer_types") or [  # transformers 4's folders name the pattern only: every sixth block is full
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
    ]
    return dict(
        layer_types=kinds,
        qk_norm=True,
        sandwich_norm=True,
        norm_unit_offset=True,
        scale_embeddings=True,
        hidden_act=hf.get("hidden_activation", "gelu_pytorch_tanh"),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        rope_theta=float(full.get("rope_theta", 1e6)),
        rope_scaling=scaling,
        rope_local_base_freq=float(local.get("rope_theta", 1e4)),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
    )


def gemma_to_hf(config: GPTConfig) -> dict[str, Any]:
    """The Gemma 3 fields of an exported ``config.json``; refuses a model transformers' Gemma 3 does not compute."""
    wanted = {"qk_norm": True, "sandwich_norm": True, "norm_unit_offset": True, "scale_embeddings": True}
    wanted |= {"n_expert": 0, "attention_sinks": False, "attention_bias": False, "mlp_bias": False}
    different = {k: getattr(config, k) for k, v in wanted.items() if getattr(config, k) != v}
    if different or config.rope_scaling not in (None,) and config.rope_scaling.get("rope_type") != "linear":
        raise ValueError(
            f"a gemma3_text folder cannot hold {different or config.rope_scaling} (Gemma 3: {wanted}, linear rotary "
            "scaling or none)"
        )
    scalar = config.query_pre_attn_scalar or config.head_dim
    full = {"rope_type": "default", "rope_theta": config.rope_theta, **(config.rope_scaling or {})}
    local = {"rope_type": "default", "rope_theta": config.rope_local_base_freq or config.rope_theta}
    return {
        "hidden_activation": config.hidden_act,
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,  # (transformers: an int)
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        # (and transformers 4's fields, for the readers that take those)
        "rope_scaling": config.rope_scaling,
        "rope_local_base_freq": local["rope_theta"],
        "final_logit_softcapping": config.final_logit_softcapping,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }
