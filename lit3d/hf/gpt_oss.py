"""gpt-oss's ``config.json`` as `GPTConfig` fields and back, and its experts' tensors. No torch at import (``lit3d
plan`` reads the config half).

gpt-oss alternates windowed and full attention (``layer_types``, ``sliding_window``), has a sink logit per head and
biases on q, k, v and o, and an MoE in every block: a biased router whose top-k logits are softmaxed (lit3d's softmax
router with ``norm_topk_prob``: the same weights), and experts with biases and a clamped SwiGLU. Its folders keep each
layer's experts fused, ``[in, out]`` as ``x @ W`` reads them: ``gate_up_proj`` ``[expert, d, 2 f]`` with the gate in
the even columns and up in the odd ones, ``down_proj`` ``[expert, f, d]``, and their ``*_bias`` ``[expert, out]``. The
published weights hold the experts in MXFP4 (``*_blocks``, ``*_scales``, a ``quantization_config``): refused on import
by `lit3d.hf.config`, naming that field; dequantize the folder to bf16 first.
"""

from __future__ import annotations

import re
from typing import Any

from lit3d.models.config import GPTConfig

LAYER = "model.layers.{i}.mlp"
PART = re.compile(r"blocks\.(\d+)\.mlp\.(router\.gate\.(?:weight|bias)|experts\.\w+)$")


def gpt_oss_name(name: str) -> str | None:
    """The gpt-oss name of a lit3d router or expert tensor (gate and up: their fused tensor's); None for another."""
    match = PART.match(name)
    if match is None:
        return None
    part = match.group(2).replace("router.gate.", "router.").replace("gate_proj", "gate_up_proj")
    return f"{LAYER.format(i=match.group(1))}.{part.replace('up_proj', 'gate_up_proj', part.startswith('experts.up'))}"


def gpt_oss_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The `GPTConfig` fields of a gpt-oss ``config.json`` besides the common ones."""
    kinds = hf.get("layer_types") or [  # (transformers' default: windowed and full blocks in turn, windowed first)
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(hf["num_hidden_layers"])
    ]
    return dict(
        layer_types=kinds,
        d_ff=hf["intermediate_size"],
        n_expert=hf["num_local_experts"],
        n_expert_per_token=hf["num_experts_per_tok"],
        d_ff_expert=hf["intermediate_size"],
        norm_topk_prob=True,
        aux_loss_coef=hf.get("router_aux_loss_coef", 0.9),
        attention_sinks=True,
        attention_bias=bool(hf.get("attention_bias", True)),
        mlp_bias=True,
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
    )


def gpt_oss_to_hf(config: GPTConfig) -> dict[str, Any]:
    """The gpt-oss fields of an exported ``config.json``; refuses a model transformers' gpt-oss does not compute."""
    wanted = {"n_shared_experts": 0, "first_dense_layers": 0, "router": "softmax", "norm_topk_prob": True}
    wanted |= {"attention_sinks": True, "mlp_bias": True, "d_ff_expert": config.d_ff, "qk_norm": False}
    different = {k: getattr(config, k) for k, v in wanted.items() if getattr(config, k) != v}
    if not config.n_expert or config.swiglu_limit is None or different:
        raise ValueError(
            f"a gpt_oss folder cannot hold n_expert={config.n_expert}, swiglu_limit={config.swiglu_limit}, "
            f"{different} (gpt-oss: an MoE in every block with a clamped SwiGLU, {wanted})"
        )
    return {
        "num_local_experts": config.n_expert,
        "num_experts_per_tok": config.n_expert_per_token,
        "router_aux_loss_coef": config.aux_loss_coef,
        "output_router_logits": False,
        "attention_bias": config.attention_bias,
        "swiglu_limit": config.swiglu_limit,
        "swiglu_alpha": config.swiglu_alpha,
    }


def experts_from_hf(config: GPTConfig, tensors: dict[str, Any]) -> dict[str, Any]:
    """Each layer's router and experts by lit3d name (`lit3d.models.moe`), from a gpt-oss folder's tensors; what is
    missing is left out (the caller names it)."""
    out = {}
    for i in range(config.n_layer):
        layer, block = LAYER.format(i=i), f"blocks.{i}.mlp"
        for part in ("weight", "bias"):
            if f"{layer}.router.{part}" in tensors:
                out[f"{block}.router.gate.{part}"] = tensors[f"{layer}.router.{part}"]
        fused = {name: tensors.get(f"{layer}.experts.{name}") for name in ("gate_up_proj", "gate_up_proj_bias")}
        for name, value in fused.items():
            if value is not None:  # the gate in the even columns, up in the odd ones
                suffix = name.removeprefix("gate_up_proj")
                out[f"{block}.experts.gate_proj{suffix}"] = value[..., ::2]
                out[f"{block}.experts.up_proj{suffix}"] = value[..., 1::2]
        for name in ("down_proj", "down_proj_bias"):
            if f"{layer}.experts.{name}" in tensors:
                out[f"{block}.experts.{name}"] = tensors[f"{layer}.experts.{name}"]
    return out


def experts_to_hf(state: dict[str, Any]) -> dict[str, Any]:
    """The routers and experts of a lit3d state dict (names relative to the `Transformer`) as gpt-oss names them:
    gate and up interleaved again."""
    import torch

    out = {}
    for name, value in state.items():
        block, _, rest = name.partition(".mlp.")
        if not rest or not block.startswith("blocks.") or not rest.startswith(("router.", "experts.")):
            continue
        layer = LAYER.format(i=block.removeprefix("blocks."))
        if rest.startswith("router.gate."):
            out[f"{layer}.router.{rest.removeprefix('router.gate.')}"] = value
        elif rest.startswith("experts.down_proj"):
            out[f"{layer}.{rest}"] = value
        elif rest.startswith("experts.gate_proj"):
            suffix = rest.removeprefix("experts.gate_proj")
            up = state[f"{block}.mlp.experts.up_proj{suffix}"]
            out[f"{layer}.experts.gate_up_proj{suffix}"] = torch.stack((value, up), dim=-1).flatten(-2)
    return {name: value.contiguous() for name, value in out.items()}
