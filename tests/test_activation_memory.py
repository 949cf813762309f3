"""The planner's activation memory against what autograd really saves (saved-tensor hooks, each storage once).

Covered here, in fp32: TP 1 with recompute off and full, per block and at the output layer; TP 2 (one rank of a
fake process group: real local shards, no real collectives) with and without sequence parallelism. Not yet:
selective recompute (its kept tensors live in the checkpoint's own cache, out of reach of these hooks) and
bf16-mixed (autocast keeps a bf16 copy of each linear's input).
"""

import pytest
import torch

from lit3d import GPTConfig
from lit3d.model import Block, Transformer, cross_entropy, rotary_tables
from lit3d.planner.estimate import activation_elements_per_token, output_layer_bytes
from lit3d.strategies.recompute import apply_activation_checkpointing

CONFIG = GPTConfig(n_layer=1, n_head=4, n_kv_head=2, d_model=64, d_ff=160, vocab_size=250, max_seq_len=64)
BATCH, SEQ = 2, 32


def saved_bytes(run, exclude: set[int]) -> int:
    """Bytes of the tensors autograd saves while ``run()`` runs forward, each storage once (a DTensor's local
    shard), leaving out the storages in ``exclude`` (parameters, the shared rotary tables)."""
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(seen.values())


def shared(module: torch.nn.Module) -> set[int]:
    tables = rotary_tables(SEQ, CONFIG.head_dim, CONFIG.rope_theta, torch.device("cpu"))
    return {getattr(t, "_local_tensor", t).untyped_storage().data_ptr() for t in [*module.parameters(), *tables]}


@pytest.mark.parametrize("checkpointing", [False, "full"])
def test_a_block_saves_what_the_planner_counts(checkpointing):
    block = Block(CONFIG)
    if checkpointing:
        apply_activation_checkpointing([block], checkpointing)
    x = torch.randn(BATCH, SEQ, CONFIG.d_model, requires_grad=True)
    measured = saved_bytes(lambda: block(x), shared(block))
    planned = activation_elements_per_token(CONFIG, 1, False, checkpointing) * BATCH * SEQ * 4
    assert measured == pytest.approx(planned, rel=0.01)


def test_the_output_layer_saves_what_the_planner_counts():
    net = Transformer(CONFIG)
    net.reset_parameters(0)
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
    whole = saved_bytes(lambda: cross_entropy(net(ids), ids), shared(net))
    block_input = torch.randn(BATCH, SEQ, CONFIG.d_model, requires_grad=True)
    block = saved_bytes(lambda: net.blocks["0"](block_input), shared(net))
    ids_bytes = BATCH * SEQ * 8  # the embedding keeps the token ids
    planned = output_layer_bytes(CONFIG, 1, False, BATCH * SEQ, 4)
    assert whole - block - ids_bytes == pytest.approx(planned, rel=0.01)


@pytest.fixture(scope="module")
def tp2_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_tensor_parallel_block_saves_what_the_planner_counts(tp2_mesh, sequence_parallel):
    from lit3d.model import TENSOR_PARALLEL_PLAN
    from lit3d.strategies.layout import Layout
    from lit3d.strategies.parallelize import parallelize_network

    net, layout = Transformer(CONFIG), Layout(dp=1, tp=2, pp=1, devices_per_node=2)
    parallelize_network(net, TENSOR_PARALLEL_PLAN, layout, {"tp": tp2_mesh}, 0, zero_stage=0,
                        sequence_parallel=sequence_parallel)  # fmt: skip
    block = net.blocks["0"]
    x = torch.randn(BATCH, SEQ // 2 if sequence_parallel else SEQ, CONFIG.d_model, requires_grad=True)
    measured = saved_bytes(lambda: block(x), shared(net))
    planned = activation_elements_per_token(CONFIG, 2, sequence_parallel, False) * BATCH * SEQ * 4
    assert measured == pytest.approx(planned, rel=0.01)
    unsplit = activation_elements_per_token(CONFIG, 1, False, False) * BATCH * SEQ * 4
    if sequence_parallel:  # Korthikanti et al. 2022, Eq. 4: TP + SP keeps 1/t of the unsplit layer
        assert measured / (unsplit / 2) == pytest.approx(1.0, abs=0.02)
    else:  # without SP the norms and the gathered linear inputs stay whole
        assert measured / (unsplit / 2) > 1.2
