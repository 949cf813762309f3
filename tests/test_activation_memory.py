"""The planner's activation memory against what autograd really saves (saved-tensor hooks, each storage once).

Covered here: one process (TP 1) in fp32, with recompute off and full, per block and at the output layer.
Not yet: TP > 1, sequence parallel, selective recompute (its kept tensors live in the checkpoint's own cache, out
of reach of these hooks) and bf16-mixed (autocast's bf16 copies of each linear's input).
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
    """Bytes of the tensors autograd saves while ``run()`` runs forward, each storage once, leaving out the
    storages in ``exclude`` (parameters, the shared rotary tables)."""
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(seen.values())


def shared(module: torch.nn.Module) -> set[int]:
    tables = rotary_tables(SEQ, CONFIG.head_dim, CONFIG.rope_theta, torch.device("cpu"))
    return {t.untyped_storage().data_ptr() for t in [*module.parameters(), *tables]}


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
