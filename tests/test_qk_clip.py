"""QK-clip (MuonClip, `lit3d.models.qk_clip`): the largest logit of each head as the attention's mask lets queries see
keys, the rescaling that makes a clipped head's logits exactly ``γ`` times what they were (grouped-query, multi-head
with biases, latent attention), the optimizer applying it after its update, and what is refused with it, by name. Its
layouts against one process: `tests/muon_layouts.py` (``muon_clip_*``)."""

import math

import pytest
import torch
from layouts import STEPS
from muon_layouts import MUON_LAYOUTS

from lit3d.models.config import GPTConfig
from lit3d.models.documents import Documents, window_mask
from lit3d.models.muon import Muon, laid_out_as
from lit3d.models.qk_clip import HeadLogits, clip_factors, record_logits, step_maxima
from lit3d.models.transformer import Transformer


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("packed", [False, True])
def test_the_largest_logit_of_each_head_is_over_the_keys_its_queries_see(window, packed):
    torch.manual_seed(0)
    batch, seq, heads, kv_heads, dim, scale = 2, 12, 4, 2, 8, 0.3
    q, k = torch.randn(batch, seq, heads, dim), torch.randn(batch, seq, kv_heads, dim)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], list(range(seq))])
    documents = Documents.of(positions) if packed else None
    record = HeadLogits()
    record.record(q, k, scale, documents, window)
    record.record(q * 0.5, k, scale, documents, window)  # (a second forward of the step: the larger kept)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(heads // kv_heads, dim=2)) * scale
    seen = window_mask(seq, window or seq, q.device)[None, None]
    if packed:
        segments = torch.cumsum(positions == 0, dim=-1)
        seen = seen & (segments[:, None, :, None] == segments[:, None, None, :])
    expected = scores.masked_fill(~seen, -math.inf).amax(dim=(0, 2, 3))
    assert torch.allclose(record.take(2), expected, rtol=1e-6) and record.take(2) is None
    with torch.no_grad():  # (evaluation: nothing recorded)
        record.record(q, k, scale, documents, window)
    assert record.history == []
    record.record(q * 9, k, scale, documents, window)  # (a pipeline stage's placeholders, before the step's forwards)
    record.record(q, k, scale, documents, window)
    assert torch.allclose(record.take(1), expected, rtol=1e-6)


LATENT = dict(kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6)
FAMILIES = {
    "grouped-query": dict(n_head=4, n_kv_head=2),
    "multi-head with biases": dict(n_head=4, n_kv_head=4, qkv_bias=True),
    "latent": dict(n_head=4, n_kv_head=4, head_dim=12, **LATENT),
    "windowed with sinks": dict(n_head=4, n_kv_head=2, sliding_window=6, attention_sinks=True, attention_bias=True),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_clipped_heads_largest_logit_becomes_the_threshold_and_the_others_are_untouched(family):
    """The factors applied to the weights: each head over the threshold now peaks exactly at it (its logits scaled by
    ``γ``: queries by ``γ`` where a key head serves two query heads, both by ``√γ`` where it serves one, latent
    attention's rotated query part by ``γ`` and its unrotated parts by ``√γ``), every other head's peak unchanged."""
    config = GPTConfig(n_layer=1, d_model=32, d_ff=64, vocab_size=64, max_seq_len=16, init_std=0.3, **FAMILIES[family])
    torch.manual_seed(0)
    model = Transformer(config)
    model.to_empty(device="cpu")
    model.reset_parameters(seed=1)
    for name, param in model.named_parameters():
        if name.endswith("bias") or name.endswith("sinks.weight"):
            torch.nn.init.normal_(param, std=0.5, generator=torch.Generator().manual_seed(len(name)))
    record_logits(model)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    model(tokens)
    before = step_maxima(model, config, 1, torch.device("cpu"))
    threshold = float(before.median())
    clipped = before > threshold
    assert 0 < clipped.sum() < before.numel()
    factors = clip_factors(model, before, threshold)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, rows in factors.items():
            params[name].mul_(laid_out_as(params[name], rows))
    model(tokens)
    after = step_maxima(model, config, 1, torch.device("cpu"))
    assert torch.allclose(after[clipped], torch.full_like(after[clipped], threshold), rtol=1e-5)
    assert torch.equal(after[~clipped], before[~clipped])


def test_the_optimizer_rescales_what_it_stepped_after_its_update():
    """`Muon.rescale_after_step`: the next step's update, then each row's factor (a matrix on Muon, a bias on AdamW);
    the step after that one updates only."""
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4))
    twin_weight, twin_bias = (torch.nn.Parameter(p.detach().clone()) for p in (weight, bias))
    groups = lambda w, b: [{"params": [w], "muon": True}, {"params": [b], "weight_decay": 0.0}]
    clipped = Muon(groups(weight, bias), lr=0.02, ns_dtype=torch.float32, names=["w", "b"])
    plain = Muon(groups(twin_weight, twin_bias), lr=0.02, ns_dtype=torch.float32, names=["w", "b"])
    rows = torch.tensor([1.0, 0.5, 1.0, 0.25])
    for step in range(2):
        for p in (weight, bias, twin_weight, twin_bias):
            p.grad = torch.ones_like(p) * (step + 1)
        if step == 0:
            clipped.rescale_after_step({"w": rows, "b": rows})
        clipped.step(), plain.step()
        if step == 0:
            assert torch.equal(weight, twin_weight * rows[:, None]) and torch.equal(bias, twin_bias * rows)
            with torch.no_grad():
                twin_weight.copy_(weight), twin_bias.copy_(bias)
    assert torch.equal(weight, twin_weight) and torch.equal(bias, twin_bias)
    with pytest.raises(KeyError, match=r"no parameter of this optimizer is named \['q'\]"):
        clipped.rescale_after_step({"q": rows})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"muon_qk_clip": 100.0}, "muon_qk_clip=100.0 with optimizer='adamw': QK-clip is MuonClip's"),
     ({"optimizer": "muon", "muon_qk_clip": 0.0}, "muon_qk_clip=0.0 must be a positive threshold"),
     ({"optimizer": "muon", "muon_qk_clip": 100.0, "config": dict(n_layer=1, n_head=2, d_model=16, d_ff=32,
       vocab_size=32, qk_norm=True)}, "muon_qk_clip=100.0 with qk_norm=True: each query and key head is normalised")],
)  # fmt: skip
def test_qk_clip_without_muon_or_on_normalised_heads_is_refused_when_the_model_is_built(kwargs, message):
    from lit3d import GPT

    with pytest.raises(ValueError, match=message):
        GPT(**kwargs)


@pytest.mark.parametrize(
    ("settings", "layout", "message"),
    [({"context_parallel_size": 2}, dict(dp=1, cp=2), "with context_parallel_size=2: the ring attention does not"),
     ({"islands": 2}, dict(dp=2), "with islands=2: each island trains its own weights"),
     ({"sync_every": 4}, dict(dp=2), "with sync_every=4: DiLoCo's outer steps move the weights")],
)  # fmt: skip
def test_qk_clip_where_a_heads_logits_or_weights_are_not_one_ranks_is_refused_before_the_ranks_start(
    settings, layout, message
):
    from lit3d import GPT
    from lit3d.parallel.layout import Layout
    from lit3d.parallel.settings import Parallelism
    from lit3d.strategies.checks import check_run

    model = GPT("tiny", optimizer="muon", muon_qk_clip=50.0)
    check_run(Parallelism(), Layout(dp=2, tp=1, pp=1, devices_per_node=2), model, None, None)  # (plain DP: taken)
    placed = Layout(**{"tp": 1, "pp": 1, "devices_per_node": 2, **layout})
    with pytest.raises(ValueError, match=f"muon_qk_clip=50.0 {message}"):
        check_run(Parallelism(**settings), placed, model, None, None)


@pytest.mark.parametrize("layout", [name for name in MUON_LAYOUTS if "clip" in name])
def test_qk_clip_clips_the_heads_one_process_clips_where_heads_are_split_sliced_or_staged(
    layout, layout_runs, muon_references
):
    """TP2 (each rank its heads), DP2 at ZeRO-1 (each replica's logits, their max, the factors on its slices) and at
    ZeRO-2 (on its shards, the blocks unsharded when the logits are taken), PP2 (each stage its blocks): every step's
    largest logit and count of clipped heads, and the weights at the end (where rank 0 holds them all), one process's
    (their losses: tests/test_muon.py). One process clips some heads and not others, so a layout that clipped none,
    all, or the wrong ones would differ."""
    run, reference = layout_runs[layout], muon_references["clip"]
    clipped = reference["qk_clip"]["clipped_heads"]
    assert len(clipped) == STEPS and 0 < sum(clipped) < 8 * STEPS, clipped
    assert run["qk_clip"]["clipped_heads"] == clipped
    assert run["qk_clip"]["max_logit"] == pytest.approx(reference["qk_clip"]["max_logit"], rel=1e-6)
    if "pp2" not in layout:
        assert run["whole_param_sum"] == pytest.approx(reference["whole_param_sum"], rel=1e-7)
