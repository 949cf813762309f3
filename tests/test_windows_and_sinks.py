"""gpt-oss's and Gemma 3's attention (windows, sinks, Gemma's scale), their presets' parameter counts against the
published ones, and what lit3d refuses of them, by name. Their folders' import and export: tests/test_families.py;
their layouts: tests/family_layouts.py."""

import pytest
import torch

from lit3d import GPTConfig
from lit3d.models.attention import causal_attention, causal_bias, reference_attention
from lit3d.models.documents import Documents
from lit3d.parallel.context import check_context_parallel


def _qkv(heads: int = 4, kv_heads: int = 2, seq: int = 32):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, seq, heads, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    k, v = (
        torch.randn(2, seq, kv_heads, 16, dtype=torch.float64, generator=generator, requires_grad=True) for _ in "kv"
    )
    sinks = torch.randn(heads, dtype=torch.float64, generator=generator, requires_grad=True)
    return q, k, v, sinks


@pytest.mark.parametrize("window, with_sinks", [(8, False), (None, True), (8, True), (1, True), (40, False)])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_windows_and_sinks_compute_the_textbook_formula_forward_and_backward(window, with_sinks, kv_heads):
    """SDPA with the window's mask and the sink as one more key (a head coordinate of its own) against the softmax
    written out: outputs and every gradient, the sinks' included; a window of 1 sees only itself, one of 40 all."""
    q, k, v, sinks = _qkv(kv_heads=kv_heads)
    sinks = sinks if with_sinks else None
    ours = causal_attention(q, k, v, "sdpa", window=window, sinks=sinks)
    theirs = reference_attention(q, k, v, window, sinks)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    leaves = [t for t in (q, k, v, sinks) if t is not None]
    grads = torch.autograd.grad((ours * torch.arange(16.0, dtype=ours.dtype)).sum(), leaves)
    expected = torch.autograd.grad((theirs * torch.arange(16.0, dtype=theirs.dtype)).sum(), leaves)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_a_window_sees_nothing_older_than_itself():
    q, k, v, _ = _qkv()
    changed = v.detach().clone()
    changed[:, :10] += 1.0  # tokens 0-9: out of a window of 8 from token 17 on
    before, after = (causal_attention(q, k, values, "sdpa", window=8)[:, 17:] for values in (v, changed))
    torch.testing.assert_close(before, after, rtol=0, atol=0)
    assert not torch.equal(causal_attention(q, k, changed, "sdpa")[:, 17:], before)  # (whole context: it would)


def test_packed_documents_with_windows_and_sinks_give_each_document_its_own_attention():
    q, k, v, sinks = _qkv()
    positions = torch.cat((torch.arange(10), torch.arange(22))).repeat(2, 1)  # documents of 10 and 22 tokens
    ours = causal_attention(q, k, v, "sdpa", Documents.of(positions), window=8, sinks=sinks)
    alone = [reference_attention(q[:, s], k[:, s], v[:, s], 8, sinks) for s in (slice(0, 10), slice(10, 32))]
    torch.testing.assert_close(ours, torch.cat(alone, dim=1), rtol=0, atol=1e-12)


def test_gemmas_query_pre_attn_scalar_scales_the_scores_instead_of_the_head_width():
    q, k, v, _ = _qkv()
    scaled = causal_attention(q, k, v, "sdpa", window=8, scale=12**-0.5)
    by_hand = reference_attention(q * (16 / 12) ** 0.5, k, v, window=8)  # the reference divides by √16
    torch.testing.assert_close(scaled, by_hand, rtol=0, atol=1e-12)


def test_one_mask_serves_every_windowed_layer_forward_and_length():
    """The memory a window saves is not spent on masks: one bias per (window, dtype, sink), whichever layer, forward or
    shorter sequence asks (a corner of the longest's: a generation growing token by token keeps one), its rows aligned
    for SDPA's memory-efficient kernel (which would copy it otherwise); a packed batch: one per forward."""
    from lit3d.models.attention import _BIASES

    cpu = torch.device("cpu")
    longest = causal_bias(64, 8, cpu, torch.float32, sink=True)
    for seq in range(1, 64):
        shorter = causal_bias(seq, 8, cpu, torch.float32, sink=True)
        assert shorter.shape == (seq, seq + 1) and shorter.data_ptr() == longest.data_ptr()
    assert sum(key[:2] == (8, "cpu") and key[2:] == (torch.float32, True) for key in _BIASES) == 1
    assert longest.stride(0) % 16 == 0 and torch.equal(longest[:, 0], torch.zeros(64))  # (the sink's column first)
    documents = Documents.of(torch.arange(32).repeat(2, 1))
    assert documents.causal_bias(torch.float32, 8, True) is documents.causal_bias(torch.float32, 8, True)


def test_a_mask_made_under_inference_mode_serves_training_after():
    """Lightning's sanity check validates under inference mode before the first training step: the mask it makes
    (kept for the training forwards after) must be one autograd can save."""
    q, k, v, sinks = _qkv(seq=48)
    with torch.inference_mode():
        causal_attention(q.detach(), k.detach(), v.detach(), "sdpa", window=7, sinks=sinks.detach())
    causal_attention(q, k, v, "sdpa", window=7, sinks=sinks).sum().backward()
    assert sinks.grad is not None


@pytest.mark.parametrize(
    "preset, total, active",
    [("gpt-oss-20b", 20.91e9, 3.61e9), ("gpt-oss-120b", 116.83e9, 5.13e9), ("gemma-3-1b", 1.00e9, None),
     ("gemma-3-4b", 3.88e9, None), ("gemma-3-12b", 11.77e9, None), ("gemma-3-27b", 27.01e9, None)],
)  # fmt: skip
def test_presets_hold_the_published_parameter_counts_within_one_percent(preset, total, active):
    """gpt-oss's model card: 20.91B and 116.83B parameters, 3.61B and 5.13B active per token, the active count leaving
    out the embedding (the unembedding counted); Gemma 3's text models (the 4B, 12B and 27B releases' counts hold their
    vision encoder too, which lit3d does not build)."""
    config = GPTConfig.from_name(preset)
    assert abs(config.num_params / total - 1) < 0.01
    if active is not None:
        assert abs((config.active_params - config.embedding_params) / active - 1) < 0.01


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gemma-3-4b"])
def test_a_presets_model_holds_the_parameters_its_config_counts(preset):
    from lit3d.models.transformer import Transformer

    config = GPTConfig.from_name(preset).replace(n_layer=2, layer_types=["sliding_attention", "full_attention"])
    with torch.device("meta"):
        network = Transformer(config)
    padding = (config.padded_vocab_size - config.vocab_size) * config.d_model * (1 if config.tie_embeddings else 2)
    assert sum(p.numel() for p in network.parameters()) - padding == config.num_params


@pytest.mark.parametrize(
    "fields, message",
    [({"sliding_window": 0}, "sliding_window=0 must be a positive number"),
     ({"sliding_window": 8, "layer_types": ["sliding_attention"]}, "one of sliding_attention, full_attention per "
                                                                    "block \\(n_layer=4\\)"),
     ({"layer_types": ["sliding_attention"] * 4}, "has windowed blocks: set sliding_window too"),
     ({"sliding_window": 8, "layer_types": ["local"] * 4}, "\\['local'\\] is not"),
     ({"hidden_act": "relu"}, "hidden_act='relu' is not one of"),
     ({"swiglu_limit": -1.0}, "'swiglu_limit': -1.0.*must be positive"),
     ({"kv_lora_rank": 16, "attention_sinks": True}, "latent attention .* has no windows, sinks or biases")],
)  # fmt: skip
def test_bad_window_and_gemma_settings_are_refused_naming_the_values(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(n_layer=4, **fields)


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gemma-3-27b"])
def test_context_parallelism_takes_windows_and_sinks_and_the_planner_plans_it(preset, capsys):
    """The ring computes windows, sinks and Gemma's score scale (`tests/test_context_parallel.py`, and the families'
    CP2 layouts in `tests/test_families.py`): nothing is refused, and `lit3d plan` plans the model at CP2."""
    import json

    from lit3d.cli import main

    check_context_parallel(2, 4096)
    main(["plan", "--model", preset, "--context_parallel_size", "2", "--tensor_parallel_size", "1",
          "--pipeline_parallel_size", "1", "--seq_len", "8192", "--global_batch_size", "64", "--json"])  # fmt: skip
    assert json.loads(capsys.readouterr().out)["layout"]["context_parallel_size"] == 2


def test_an_export_refuses_a_family_that_cannot_hold_the_models_settings():
    from lit3d.hf.folders import config_to_hf

    with pytest.raises(ValueError, match="a llama folder cannot hold \\{'attention_sinks': True\\}"):
        config_to_hf(GPTConfig(attention_sinks=True), torch.float32)
    with pytest.raises(ValueError, match="a gemma3_text folder cannot hold"):
        config_to_hf(GPTConfig(family="gemma3_text", qk_norm=True), torch.float32)


def test_a_transformers_4_gemma_3_folder_without_layer_types_windows_five_blocks_of_six():
    """Gemma 3's published config.json files name only ``sliding_window_pattern``: every sixth block attends to the
    whole context (it was read as every block windowed), and the windowed ones take the local rotary base."""
    from lit3d.hf.config import config_from_hf

    hf = dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
              num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512,
              sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4,
              query_pre_attn_scalar=256)  # fmt: skip
    config = config_from_hf(hf)
    assert [config.window(i) for i in range(12)] == [512] * 5 + [None] + [512] * 5 + [None]
    assert (config.rope_theta, config.rope_local_base_freq) == (1e6, 1e4)
    assert config.num_params == GPTConfig.from_name("gemma-3-1b").num_params


def test_the_planner_keeps_k_and_v_once_per_query_head_where_a_gpu_runs_the_masked_kernel():
    """On a GPU the masked kernel takes no grouped heads (`masked_attention` repeats K/V first): gpt-oss's 64 query
    heads over 8 K/V heads keep K and V eight times in every block (sinks), Gemma 3's in its 52 windowed blocks of 62,
    Llama's only with packed documents; a CPU keeps them once (its kernel takes grouped heads)."""
    from lit3d.planner.block_saves import attention_bytes_per_token, repeated_kv_share

    oss, gemma, llama = (GPTConfig.from_name(name) for name in ("gpt-oss-120b", "gemma-3-27b", "llama-8b"))
    assert (repeated_kv_share(oss, True, False), repeated_kv_share(oss, False, True)) == (1.0, 0.0)
    assert repeated_kv_share(gemma, True, False) == 52 / 62
    assert (repeated_kv_share(llama, True, False), repeated_kv_share(llama, True, True)) == (0.0, 1.0)
    more = attention_bytes_per_token(oss, 2, 1.0) - attention_bytes_per_token(oss, 2, 0.0)
    assert more == 2 * 2 * (64 - 8) * 64 * (64 + 8) / 64  # bf16 K and V of 56 more heads, each 8 wider for the sink
