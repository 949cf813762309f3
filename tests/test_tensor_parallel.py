"""Tensor parallelism in one process: a fake process group stands in for the other ranks."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from lit3d import GPTConfig
from lit3d.models.tp_plan import TENSOR_PARALLEL_PLAN
from lit3d.models.transformer import Block
from lit3d.strategies.split.tensor_parallel import apply_tensor_parallel


@pytest.fixture
def tp_mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


def block_plan():
    return {k.removeprefix("blocks.*."): v for k, v in TENSOR_PARALLEL_PLAN.items() if k.startswith("blocks.*.")}


def count(mode):
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


@pytest.mark.parametrize(
    "sequence_parallel, expected",
    [
        (False, {"all_reduce": 2}),  # Megatron: one all-reduce after attention, one after the MLP
        (True, {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}),  # the same, split in two halves
    ],
)
def test_one_block_issues_the_megatron_collectives(tp_mesh, sequence_parallel, expected):
    block = Block(GPTConfig(n_layer=1, n_head=4, n_kv_head=2, d_model=32, d_ff=64))
    apply_tensor_parallel(block, block_plan(), tp_mesh, sequence_parallel)
    seq = 4 if sequence_parallel else 8  # under sequence parallel each rank holds half of the sequence
    x = torch.randn(2, seq, 32, requires_grad=True)
    with CommDebugMode() as forward:
        y = block(x)
    with CommDebugMode() as backward:
        y.sum().backward()
    assert count(forward) == expected
    assert count(backward) == expected  # the mirror image in backward
    assert block.attn.q_proj.weight.to_local().shape == (16, 32)  # 2 of 4 query heads
    assert block.attn.k_proj.weight.to_local().shape == (8, 32)  # 1 of 2 key/value heads
    assert block.mlp.down_proj.weight.to_local().shape == (32, 32)  # half of d_ff


def test_unknown_roles_are_refused(tp_mesh):
    block = Block(GPTConfig(n_layer=1, n_head=4, d_model=32, d_ff=64))
    with pytest.raises(ValueError, match=r"unknown tensor-parallel roles \['diagonal'\]"):
        apply_tensor_parallel(block, {"attn.q_proj": "diagonal"}, tp_mesh, False)


def test_sequence_parallel_keeps_a_frozen_norm_frozen_and_adapters_follow_their_linears_split(tp_mesh):
    """PyTorch's `SequenceParallel` re-registers a norm's weight as a parameter that trains; a LoRA run's norms
    must stay frozen. A column-parallel linear's adapter splits B along the output and keeps A whole, a row-parallel
    one splits A along the input and keeps B whole."""
    from torch.distributed.tensor import Replicate, Shard

    from lit3d.models.lora import LoRA, freeze_all_but_adapters

    block = Block(GPTConfig(n_layer=1, n_head=4, n_kv_head=2, d_model=32, d_ff=64), lora=LoRA(targets=("q", "o")))
    freeze_all_but_adapters(block)
    apply_tensor_parallel(block, block_plan(), tp_mesh, sequence_parallel=True)
    assert not block.attn_norm.weight.requires_grad and not block.attn.q_proj.weight.requires_grad
    q, o = block.attn.q_proj, block.attn.o_proj
    assert (q.lora_a.placements, q.lora_b.placements) == ((Replicate(),), (Shard(0),))
    assert (o.lora_a.placements, o.lora_b.placements) == ((Shard(1),), (Replicate(),))
    assert q.lora_a.requires_grad and o.lora_b.requires_grad
