import pytest
import torch

from lit3d import GPT, GPTConfig
from lit3d.models.config import PRESETS


@pytest.mark.parametrize("name", ["tiny", "125m", "1b", "llama-8b", "llama-70b", "llama-405b", "gpt3-175b"])
def test_preset_parameter_count_matches_the_built_model(name):
    config = GPTConfig.from_name(name)
    with torch.device("meta"):  # no memory, no init: shapes only
        model = GPT(config)
        model.configure_model()
    padding = (config.padded_vocab_size - config.vocab_size) * config.d_model * (1 if config.tie_embeddings else 2)
    assert sum(p.numel() for p in model.parameters()) == config.num_params + padding


def test_known_sizes():
    billions = {name: GPTConfig.from_name(name).num_params / 1e9 for name in PRESETS}
    assert billions["llama-8b"] == pytest.approx(8.03, abs=0.01)
    assert billions["llama-70b"] == pytest.approx(70.55, abs=0.01)
    assert billions["llama-405b"] == pytest.approx(405.85, abs=0.01)
    assert billions["gpt3-175b"] == pytest.approx(175.2, abs=0.1)


@pytest.mark.parametrize(
    "name, total, active", [("deepseek-v3", 671, 37), ("kimi-k2", 1030, 32), ("moonlight-16b-a3b", 16, 3)]
)
def test_deepseek_v3_shaped_presets_have_their_published_sizes(name, total, active):
    """Billions of parameters as published: the total within 1 % (DeepSeek-V3's 671B leave its MTP depth out, as
    `num_params` does); the active ones, published in whole billions, are those a token computes with (the embedding
    is a lookup: 36.6B, 31.7B and 2.6B, where counting it too would round DeepSeek-V3's 37.55B to 38)."""
    config = GPTConfig.from_name(name)
    assert config.num_params / 1e9 == pytest.approx(total, rel=0.01)
    assert round((config.active_params - config.embedding_params) / 1e9) == active


def test_derived_fields_are_computed_in_one_place():
    config = GPTConfig(n_head=8, d_model=256, vocab_size=1000, n_kv_head=None, d_ff=None)
    assert config.n_kv_head == 8
    assert config.head_dim == 32
    assert config.d_ff == 768  # 8/3 * 256 rounded up to 256
    assert config.padded_vocab_size == 1024
    assert config.replace(vocab_size=1100).padded_vocab_size == 1152
    assert GPTConfig(**config.to_dict()) == config


def test_bad_configs_name_the_value():
    with pytest.raises(ValueError, match="unknown model preset 'llama-9b'"):
        GPTConfig.from_name("llama-9b")
    with pytest.raises(ValueError, match="n_kv_head=3 does not divide n_head=4"):
        GPTConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="n_head=5 does not divide d_model=128"):
        GPTConfig(n_head=5)
    with pytest.raises(ValueError, match="n_layer=0"):
        GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match="attention='xformers'"):
        GPTConfig(attention="xformers")


def test_config_from_yaml(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("base: llama-8b\nn_layer: 2\n")
    config = GPTConfig.load(str(path))
    assert (config.n_layer, config.d_model, config.name) == (2, 4096, "llama-8b")
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        GPTConfig.load(str(tmp_path / "missing.yaml"))


def test_0_4s_n_shared_expert_is_read_as_n_shared_experts_with_a_warning():
    """A 0.4 checkpoint's saved config names the shared experts ``n_shared_expert``: read, warned, and written back
    under HuggingFace's ``n_shared_experts``."""
    saved = {**GPTConfig.from_name("moe-tiny").to_dict(), "n_shared_expert": 2}
    del saved["n_shared_experts"]
    with pytest.warns(DeprecationWarning, match=r"n_shared_experts, HuggingFace's name \(removed in version 0.7.0\)"):
        config = GPTConfig(**saved)
    assert config.n_shared_experts == 2 and "n_shared_expert" not in config.to_dict()
