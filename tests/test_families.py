"""The model families people fine-tune, imported from and exported to HuggingFace folders built locally with
transformers: their features computed as transformers computes them."""

import pytest
import torch

from lit3d import GPT, GPTConfig
from lit3d.rotary import Rope

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}  # fmt: skip


def _llama31_folder(folder):
    """A tiny Llama 3.1-shaped folder: llama3 rotary scaling up to 131,072 positions, rope_theta 500,000."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=131072,
                         rope_parameters={"rope_theta": 500000.0, **LLAMA3_SCALING})  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_llama3_rotary_scaling_gives_transformers_logits_beyond_the_original_context(tmp_path):
    """Llama 3.1-3.3's rope_scaling: positions past 8,192 (a long tiny sequence) as transformers computes them, and
    the scaling written back on export."""
    from transformers import LlamaForCausalLM

    folder = _llama31_folder(tmp_path / "llama31")
    model = GPT.from_pretrained(str(folder))
    assert model.config.rope_scaling == LLAMA3_SCALING and model.config.max_seq_len == 131072
    tokens = torch.randint(0, 256, (1, 8300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)(input_ids=tokens).logits
        ours = model(tokens)
    assert (ours[0, 8192:] - theirs[0, 8192:]).abs().max() < 1e-4
    assert (ours - theirs).abs().max() < 1e-4
    exported = _exported(model, tmp_path)
    with torch.no_grad():
        again = LlamaForCausalLM.from_pretrained(exported, torch_dtype=torch.float32)(input_ids=tokens).logits
    assert (again - ours).abs().max() < 1e-4


def _exported(model: GPT, tmp_path) -> str:
    """``model`` saved as a lit3d checkpoint file and exported by ``lit3d export`` to a HuggingFace folder."""
    from lit3d.cli import main

    torch.save({"hyper_parameters": dict(model.hparams), "state_dict": model.state_dict()}, tmp_path / "model.ckpt")
    main(["export", "--ckpt_path", str(tmp_path / "model.ckpt"), "--output", str(tmp_path / "exported")])
    return str(tmp_path / "exported")


def test_the_frequencies_of_each_band_of_llama3_scaling():
    """Short wavelengths kept, long ones divided by the factor, the band between blended."""
    plain = Rope(500000.0).inverse_frequencies(8, torch.device("cpu"))
    scaled = Rope.of(500000.0, LLAMA3_SCALING).inverse_frequencies(8, torch.device("cpu"))
    wavelengths = 2 * torch.pi / plain  # 6.3, 167, 4,455 and 118,700 positions
    assert torch.equal(scaled[:2], plain[:2]) and scaled[3] == pytest.approx(plain[3] / 8)
    assert plain[2] / 8 < scaled[2] < plain[2] and 2048 < wavelengths[2] < 8192
    linear = Rope.of(10000.0, {"rope_type": "linear", "factor": 4.0}).inverse_frequencies(8, torch.device("cpu"))
    assert torch.allclose(linear, Rope(10000.0).inverse_frequencies(8, torch.device("cpu")) / 4)


@pytest.mark.parametrize(
    "scaling, message",
    [
        ({"rope_type": "yarn", "factor": 4.0}, "rope_type 'yarn' is not one of linear, llama3"),
        ({"rope_type": "llama3", "factor": 8.0}, "llama3 needs low_freq_factor, high_freq_factor, original_max"),
    ],
)
def test_a_rotary_scaling_lit3d_does_not_compute_is_refused_naming_it(scaling, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(rope_scaling=scaling)


@pytest.mark.parametrize(
    "preset, published",
    [("llama3.1-8b", 8_030_261_248), ("llama3.1-70b", 70_553_706_496), ("llama3.2-1b", 1_235_814_400),
     ("llama3.2-3b", 3_212_749_824), ("qwen3-8b", 8_190_735_360), ("qwen3-32b", 32_762_123_264),
     ("qwen3-30b-a3b", 30_532_122_624), ("mistral-7b", 7_248_023_552)],
)  # fmt: skip
def test_presets_hold_the_published_parameter_counts(preset, published):
    """The counts of the models' own safetensors indexes (their releases on the HuggingFace hub): exact."""
    assert GPTConfig.from_name(preset).num_params == published


def _folder(kind: str, folder):
    """A tiny Qwen3 (per-head q/k norms, heads wider than d_model / n_head) or Mistral folder, built with
    transformers."""
    import transformers

    torch.manual_seed(0)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)  # fmt: skip
    if kind == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=16, rope_parameters={"rope_theta": 1e6})
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.MistralConfig(**common, sliding_window=None)
        model = transformers.MistralForCausalLM(config)
    with torch.no_grad():  # norms away from 1, so that a missed one shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["qwen3", "mistral"])
def test_a_family_imports_and_exports_with_transformers_logits(kind, tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    folder = _folder(kind, tmp_path / kind)
    model = GPT.from_pretrained(str(folder))
    assert model.config.family == kind and model.config.qk_norm == (kind == "qwen3")
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)(input_ids=tokens).logits
        ours = model(tokens)
        assert (ours - theirs).abs().max() < 1e-4
        exported = _exported(model, tmp_path)
        assert json.loads((tmp_path / "exported" / "config.json").read_text())["model_type"] == kind
        again = AutoModelForCausalLM.from_pretrained(exported, torch_dtype=torch.float32)(input_ids=tokens).logits
    assert (again - ours).abs().max() < 1e-4


QWEN3_TINY = dict(n_layer=4, n_head=4, n_kv_head=2, head_dim=16, d_model=32, d_ff=64, vocab_size=257, max_seq_len=32,
                  qk_norm=True, family="qwen3")  # fmt: skip


def test_qwen3s_head_norms_train_like_one_process_at_tp2_and_pp2(corpus, tmp_path):
    """Each TP rank normalises its own heads, and the norms' weights get the gradient of every head."""
    from conftest import merge, pp
    from spawned import run_job, run_jobs

    base = dict(
        model=dict(config=QWEN3_TINY, learning_rate=1e-2, warmup_steps=2),
        data=dict(data_path=str(corpus), seq_len=16, global_batch_size=8, val_fraction=0.1),
        trainer=dict(max_steps=5, limit_val_batches=0),
    )
    reference = run_job(base, tmp_path / "one")["losses"]
    runs = run_jobs(2, {"tp2": merge(base, {"strategy": {"tensor_parallel_size": 2}}),
                        "pp2": merge(base, {"strategy": pp(2)})}, tmp_path)  # fmt: skip
    assert len(reference) == 5 and reference[-1] < reference[0]
    for name, run in runs.items():
        assert max(abs(a - b) for a, b in zip(run["losses"], reference)) <= 1e-5, name
