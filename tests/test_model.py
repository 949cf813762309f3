import torch

from lit3d import GPT, GPTConfig
from lit3d.models.transformer import Transformer, apply_rotary, rotary_tables


def test_logits_shape_and_grouped_query_projections(small_config):
    torch.manual_seed(0)
    model = GPT(small_config)
    tokens = torch.randint(0, 256, (3, 10))
    assert model(tokens).shape == (3, 10, 256)
    attn = model.model.blocks["0"].attn
    hd = small_config.head_dim
    assert attn.q_proj.weight.shape == (4 * hd, 32)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (2 * hd, 32)


def test_parameter_names_are_layout_free(small_config):
    names = [n for n, _ in built(small_config).named_parameters()]
    assert names[0] == "model.embed.weight"
    assert "model.blocks.1.mlp.down_proj.weight" in names
    assert names[-2:] == ["model.norm.weight", "model.head.weight"]


def test_a_stage_may_drop_embedding_head_and_blocks(small_config):
    """A pipeline stage keeps some blocks under their global names; forward passes through what is absent."""
    torch.manual_seed(0)
    full = Transformer(small_config)
    tokens = torch.randint(0, 256, (2, 8))
    first, last = Transformer(small_config), Transformer(small_config)
    first.load_state_dict(full.state_dict())
    last.load_state_dict(full.state_dict())
    del first.blocks["1"]
    first.norm = first.head = None
    del last.blocks["0"]
    last.embed = None
    assert [n for n, _ in last.named_parameters()][0] == "blocks.1.attn_norm.weight"
    torch.testing.assert_close(last(first(tokens)), full(tokens))


def built(config):
    model = GPT(config)
    assert model.model is None  # the network is built and initialised by Lightning's configure_model hook
    model.configure_model()
    return model


def test_same_seed_same_weights_whatever_the_layout(small_config):
    torch.manual_seed(7)
    a = built(small_config).state_dict()
    torch.manual_seed(7)
    b = built(small_config).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(8)
    assert not torch.equal(
        built(small_config).state_dict()["model.blocks.0.attn.q_proj.weight"], a["model.blocks.0.attn.q_proj.weight"]
    )
    # A stage that owns only block 1, initialised on its own, gets exactly block 1's weights.
    with torch.device("meta"):
        stage = Transformer(small_config)
    del stage.blocks["0"]
    stage.embed = None
    stage.to_empty(device="cpu")
    stage.reset_parameters(seed=7)
    for name, value in stage.state_dict().items():
        assert torch.equal(value, a[f"model.{name}"]), name


def test_padded_vocabulary_does_not_change_the_loss():
    """vocab 250 padded to 256: the padding rows are masked, the loss equals an unpadded model's."""
    torch.manual_seed(0)
    unpadded = built(GPTConfig(n_layer=1, n_head=2, d_model=16, d_ff=32, vocab_size=250, pad_vocab_multiple=1))
    padded = built(GPTConfig(n_layer=1, n_head=2, d_model=16, d_ff=32, vocab_size=250, pad_vocab_multiple=64))
    assert padded.model.head.weight.shape[0] == 256
    state = unpadded.state_dict()
    for key in ("model.embed.weight", "model.head.weight"):
        state[key] = torch.cat((state[key], torch.randn(6, 16)))  # even non-zero padding rows are inert
    padded.load_state_dict(state)
    tokens = torch.randint(0, 250, (2, 12))
    torch.testing.assert_close(padded.loss(tokens), unpadded.loss(tokens))
    torch.testing.assert_close(padded(tokens), unpadded(tokens))


def test_tied_embeddings_share_one_tensor():
    model = built(GPTConfig(n_layer=1, n_head=2, d_model=16, d_ff=32, tie_embeddings=True))
    assert model.model.head.weight is model.model.embed.weight
    assert sum(p.numel() for p in model.parameters()) == model.config.num_params


def test_rotary_preserves_norms_and_relative_positions():
    cos, sin = rotary_tables(16, 8, 10000.0, torch.device("cpu"))
    q, k = torch.randn(1, 1, 1, 8).expand(1, 16, 1, 8), torch.randn(1, 1, 1, 8).expand(1, 16, 1, 8)
    rq, rk = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    dots = (rq[0, 1:, 0] * rk[0, :-1, 0]).sum(-1)  # query at i+1, key at i: depends only on the offset
    torch.testing.assert_close(dots, dots[0].expand_as(dots), rtol=1e-4, atol=1e-5)


def test_gradients_reach_every_parameter(small_config):
    model = GPT(small_config)
    model.loss(torch.randint(0, 256, (2, 9))).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_rotary_tables_are_computed_once_not_per_block_and_step(monkeypatch):
    from lit3d.models import rotary
    from lit3d.models import transformer as model_module

    calls = []
    compute = rotary._rotary_tables
    monkeypatch.setattr(rotary, "_rotary_tables", lambda *a: calls.append(a[0]) or compute(*a))
    monkeypatch.setattr(rotary, "_ROTARY_TABLES", {})
    net = model_module.Transformer(GPTConfig(n_layer=3, n_head=2, d_model=16, d_ff=32, vocab_size=50, max_seq_len=16))
    net.reset_parameters(0)
    for _ in range(2):
        net(torch.randint(0, 50, (2, 8))).sum().backward()
    with torch.inference_mode():
        net(torch.randint(0, 50, (1, 4)))  # shorter: a slice of the same tables
    assert calls == [8]
    net(torch.randint(0, 50, (1, 12))).sum().backward()  # longer: computed once more, usable in backward
    assert calls == [8, 12]


def test_the_stage_clock_records_nothing_unless_enabled():
    from lit3d.strategies.pipelining.step import StageClock

    clock = StageClock(torch.device("cpu"))
    for enabled in (False, True):
        clock.enabled = enabled
        clock.start_step()
        clock.timed(0, "F", 0, lambda i: i), clock.timed(0, "B", 0, lambda i: i)
        clock.end_step()
        assert len(clock.timeline()) == (2 if enabled else 0)
