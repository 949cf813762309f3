"""The planner's torch-free description of the model (`lit3d.planner.shapes`) is the real model's, for every preset
and the tests' small models: any change to `lit3d.model` or `lit3d.moe` not made there too fails here."""

import pytest
import torch
from conftest import SMALL_GPT, SMALL_MOE

from lit3d.config import PRESETS, GPTConfig
from lit3d.model import Transformer
from lit3d.planner.shapes import block_costs, parameter_shapes
from lit3d.strategies.stages import block_costs as measured_block_costs

SMALL = {
    "small_gpt": SMALL_GPT,  # a vocabulary of 257, padded to 320
    "small_moe": SMALL_MOE,  # a dense first block, then MoE blocks
    "small_gpt_tied_head_dim": dict(SMALL_GPT, tie_embeddings=True, head_dim=16),
    "small_moe_shared_sigmoid_tied": dict(SMALL_MOE, n_shared_expert=2, router="sigmoid", tie_embeddings=True),
    "small_moe_all_experts": dict(SMALL_MOE, first_dense_layers=0),
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
