"""The planner's torch-free description of the model (`lit3d.planner.shapes`) is the real model's, for every preset
and the tests' small models: any change to `lit3d.models.transformer` or `lit3d.models.moe` not made there too fails
here."""

import pytest
import torch
from family_layouts import FAMILY_CONFIGS
from layouts import SMALL_GPT, SMALL_MOE

from lit3d.models.config import PRESETS, GPTConfig
from lit3d.models.transformer import Transformer
from lit3d.planner.shapes import block_costs, parameter_shapes
from lit3d.strategies.pipelining.chunks import block_costs as measured_block_costs

SMALL = {
    "small_gpt": SMALL_GPT,  # a vocabulary of 257, padded to 320
    "small_moe": SMALL_MOE,  # a dense first block, then MoE blocks
    "small_gpt_tied_head_dim": dict(SMALL_GPT, tie_embeddings=True, head_dim=16),
    "small_moe_shared_sigmoid_tied": dict(SMALL_MOE, n_shared_experts=2, router="sigmoid", tie_embeddings=True),
    "small_moe_all_experts": dict(SMALL_MOE, first_dense_layers=0),
    **{f"family_{name}": config for name, config in FAMILY_CONFIGS.items()},  # q/k/v biases, q/k norms
}
CONFIGS = {**{name: dict(fields, name=name) for name, fields in PRESETS.items()}, **SMALL}


@pytest.mark.parametrize("name", CONFIGS)
def test_the_planners_shapes_and_block_costs_are_the_meta_models(name):
    config = GPTConfig(**CONFIGS[name])
    with torch.device("meta"):
        network = Transformer(config)
    # names, shapes and order: the planner's tensor table is this list
    assert parameter_shapes(config) == [(n, tuple(p.shape)) for n, p in network.named_parameters()]
    # the pipeline cut's costs, as the strategy measures them on the module (a tied head counted in the last part)
    assert block_costs(config) == measured_block_costs(network)


def test_the_planners_lora_table_is_the_adapted_models_in_order_with_qwen2s_biases():
    """Adapters after their linear's bias, as `LoRALinear` registers them; a bias is frozen with its weight and split
    by TP with the linear's outputs."""
    from lit3d.models.lora import LoRA, freeze_all_but_adapters
    from lit3d.planner.tensors import parameter_table

    config, lora = GPTConfig(**FAMILY_CONFIGS["qwen2"]), LoRA(rank=4, targets=("q", "k", "v", "o", "up"))
    with torch.device("meta"):
        network = Transformer(config, lora)
    freeze_all_but_adapters(network)
    table = parameter_table(config, lora)
    assert [(t.name, t.shape, t.trains) for t in table] == [
        (n, tuple(p.shape), p.requires_grad) for n, p in network.named_parameters()
    ]
    assert {t.name: t.tp_dim for t in table if t.name.startswith("blocks.0.attn.q_proj")} == {
        "blocks.0.attn.q_proj.weight": 0, "blocks.0.attn.q_proj.bias": 0, "blocks.0.attn.q_proj.lora_a": None,
        "blocks.0.attn.q_proj.lora_b": 0}  # fmt: skip


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_the_planners_lora_table_under_latent_attention_is_the_adapted_models(q_lora_rank):
    """Adapters on latent attention's linears (its queries' with and without their low rank) and the MLP's, in the
    decoder's blocks and in multi-token prediction's: the planner's table holds the adapted model's tensors (an MoE
    layer's expert adapters listed beside their weights, where the model registers them after all three)."""
    from lit3d.models.lora import LoRA, freeze_all_but_adapters
    from lit3d.models.lora_settings import model_roles
    from lit3d.planner.tensors import parameter_table

    config = GPTConfig(**dict(FAMILY_CONFIGS["deepseek_v3"], q_lora_rank=q_lora_rank))
    lora = LoRA(rank=4, targets=model_roles(config))
    with torch.device("meta"):
        network = Transformer(config, lora)
    freeze_all_but_adapters(network)
    table = sorted((t.name, t.shape, t.trains) for t in parameter_table(config, lora))
    assert config.num_nextn_predict_layers and any(name.startswith("mtp.") and "lora" in name for name, *_ in table)
    assert table == sorted((n, tuple(p.shape), p.requires_grad) for n, p in network.named_parameters())


def test_lora_targets_a_model_lacks_are_refused_naming_them():
    from lit3d.models.lora import LoRA

    config = GPTConfig(**FAMILY_CONFIGS["deepseek_v3"])
    with pytest.raises(ValueError, match=r"deepseek_v3 has no q, v linear \(its targets: q_a, q_b, kv_a, kv_b, o,"):
        LoRA(targets=("q", "v")).check_model(config)
    LoRA(targets=("q", "v")).check_model(GPTConfig(**SMALL_GPT))  # (a Llama-shaped model has both)
