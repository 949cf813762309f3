"""The Mixture-of-Experts families in HuggingFace folders: Mixtral's, Qwen3-MoE's and DeepSeek-V3's routers (with
DeepSeek-V3's balancing bias) and experts, and the ``config.json`` fields that describe Mixtral's and Qwen3-MoE's
(DeepSeek-V3's: `lit3d.hf.deepseek`).

lit3d stacks each layer's experts into ``[expert, in, out]`` tensors (`lit3d.models.moe.Experts`). Published
checkpoints keep one ``[out, in]`` matrix per expert (Mixtral's ``w1``/``w2``/``w3``, Qwen3-MoE's
``gate_proj``/``up_proj``/
``down_proj``); transformers 5 fuses them into ``gate_up_proj`` ``[expert, 2 f, d]`` and ``down_proj``
``[expert, d, f]`` when it loads a folder, and writes them fused. Both are read; the published form is written,
which transformers loads.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from lit3d.hf.gpt_oss import experts_from_hf, gpt_oss_name
from lit3d.models.config import GPTConfig

# Per family: the router's name and each expert's matrices ({i}: the block, {e}: the expert), by lit3d name.
ROUTER = {
    "mixtral": "model.layers.{i}.block_sparse_moe.gate.weight",
    "qwen3_moe": "model.layers.{i}.mlp.gate.weight",
    "deepseek_v3": "model.layers.{i}.mlp.gate.weight",
}
MLP_EXPERT = {
    name: f"model.layers.{{i}}.mlp.experts.{{e}}.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")
}
EXPERT = {
    "mixtral": {"gate_proj": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
                "down_proj": "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
                "up_proj": "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"},
    "qwen3_moe": MLP_EXPERT,
    "deepseek_v3": MLP_EXPERT,
}  # fmt: skip
# The sigmoid router's balancing bias (a buffer: `lit3d.models.moe.Router`), by family.
ROUTER_BIAS = {"deepseek_v3": "model.layers.{i}.mlp.gate.e_score_correction_bias"}
ROUTER_PARAM = re.compile(r"blocks\.(\d+)\.mlp\.router\.gate\.weight$")
ROUTER_BIAS_BUFFER = re.compile(r"blocks\.(\d+)\.mlp\.router\.expert_bias$")
EXPERT_PARAM = re.compile(r"blocks\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)$")


def moe_family(config: GPTConfig) -> str:
    """The MoE ``model_type`` a model exports as: Qwen3-MoE for a Qwen3-shaped one, DeepSeek-V3 for one, else
    Mixtral."""
    if config.family in ("deepseek_v3", "gpt_oss"):
        return config.family
    return "qwen3_moe" if config.family in ("qwen3", "qwen3_moe") else "mixtral"


def moe_to_hf(config: GPTConfig) -> dict[str, Any]:
    """The MoE fields of the ``config.json`` of `moe_family`; refuses what that family cannot hold, naming it."""
    family = moe_family(config)
    unlike = {"n_shared_experts": 0, "first_dense_layers": 0, "router": "softmax", "n_group": 1}
    unlike |= {"routed_scaling_factor": 1.0}
    if family == "mixtral":
        unlike |= {"d_ff_expert": config.d_ff, "norm_topk_prob": True}
    different = {k: getattr(config, k) for k, v in unlike.items() if getattr(config, k) != v}
    if different:
        raise ValueError(f"a {family} folder cannot hold {different} ({family}: {unlike})")
    common = {
        "num_experts_per_tok": config.n_expert_per_token,
        "router_aux_loss_coef": config.aux_loss_coef,
        "output_router_logits": False,
    }
    if family == "mixtral":
        return common | {"num_local_experts": config.n_expert}
    qwen = {"num_experts": config.n_expert, "moe_intermediate_size": config.d_ff_expert, "mlp_only_layers": []}
    return common | qwen | {"norm_topk_prob": config.norm_topk_prob, "decoder_sparse_step": 1}


def expert_name(name: str, family: str) -> str | None:
    """The HuggingFace name of a lit3d router or expert stack (``{e}`` left for the expert); None for another."""
    if family == "gpt_oss":
        return gpt_oss_name(name)
    if match := ROUTER_PARAM.match(name):
        return ROUTER[family].format(i=match.group(1))
    if (match := ROUTER_BIAS_BUFFER.match(name)) and family in ROUTER_BIAS:
        return ROUTER_BIAS[family].format(i=match.group(1))
    if match := EXPERT_PARAM.match(name):
        return EXPERT[family][match.group(2)].format(i=match.group(1), e="{e}")
    return None


def read_experts(config: GPTConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The routers and stacked experts, by lit3d name, from the per-expert matrices of a published checkpoint or
    transformers 5's fused ones; what is missing is left out (the caller names it). Multi-token prediction's depths
    are the layers after the model's (`lit3d.hf.deepseek`), by the names of blocks after its last."""
    family, out = moe_family(config), {}
    if family == "gpt_oss":
        return experts_from_hf(config, tensors)
    layers = config.n_layer + config.num_nextn_predict_layers
    for i in (i for i in range(layers) if config.is_moe_layer(i)):
        layer = f"model.layers.{i}"
        router = tensors.get(ROUTER[family].format(i=i), tensors.get(f"{layer}.mlp.gate.weight"))
        if router is not None:
            out[f"blocks.{i}.mlp.router.gate.weight"] = router
        if family in ROUTER_BIAS and ROUTER_BIAS[family].format(i=i) in tensors:
            out[f"blocks.{i}.mlp.router.expert_bias"] = tensors[ROUTER_BIAS[family].format(i=i)]
        if f"{layer}.mlp.experts.gate_up_proj" in tensors:  # transformers 5: fused, [expert, out, in]
            gate, up = tensors[f"{layer}.mlp.experts.gate_up_proj"].chunk(2, dim=1)
            parts = {"gate_proj": gate, "up_proj": up, "down_proj": tensors[f"{layer}.mlp.experts.down_proj"]}
        else:
            parts = {}
            for name, pattern in EXPERT[family].items():
                keys = [pattern.format(i=i, e=e) for e in range(config.n_expert)]
                if all(k in tensors for k in keys):
                    parts[name] = torch.stack([tensors[k] for k in keys])
        out |= {f"blocks.{i}.mlp.experts.{name}": stacked.transpose(1, 2) for name, stacked in parts.items()}
    return out


def write_experts(name: str, value: torch.Tensor, family: str) -> dict[str, torch.Tensor]:
    """A lit3d expert stack ``[expert, in, out]`` as the family's per-expert ``[out, in]`` matrices."""
    pattern = expert_name(name, family)
    return {pattern.format(e=e): matrix.contiguous() for e, matrix in enumerate(value.transpose(1, 2))}
