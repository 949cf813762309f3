"""``lit3d export`` keeps what generation needs: the source's BOS/EOS ids and generation config, and a tokenizer
transformers can load (or one line saying none is written)."""

import json
from pathlib import Path

import pytest
import torch

from lit3d import GPT, GPTConfig
from lit3d.cli import main

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    """A tiny HuggingFace Llama with BOS 5, EOS 7 (not LlamaConfig's 1 and 2) and its own generation config."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, bos_token_id=5,
                         eos_token_id=7, pad_token_id=0)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=5, eos_token_id=[7, 9], pad_token_id=0, do_sample=True,
                                               temperature=0.6, top_p=0.9)  # fmt: skip
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    return folder


def save_checkpoint(model: GPT, path: Path, tokenizer: str = "byte") -> Path:
    """What Lightning saves of a fit, as one file (`lit3d convert`'s form): the hyper-parameters and the weights."""
    model.configure_model()
    torch.save({"hyper_parameters": dict(model.hparams), "state_dict": model.state_dict(),
                "datamodule_hyper_parameters": {"tokenizer": tokenizer}}, path)  # fmt: skip
    return path


def test_export_keeps_the_source_bos_eos_and_generation_config(llama_folder, tmp_path, capsys):
    """Fine-tuned from the folder, then again from that checkpoint: the ids travel through both."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first = save_checkpoint(GPT(pretrained=str(llama_folder)), tmp_path / "first.ckpt")
    second = save_checkpoint(GPT(pretrained=str(first)), tmp_path / "second.ckpt")
    main(["export", "--ckpt_path", str(second), "--output", str(tmp_path / "hf")])
    printed = capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (5, 7, 0)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation == json.loads((llama_folder / "generation_config.json").read_text())
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert exported.generation_config.eos_token_id == [7, 9] and exported.config.bos_token_id == 5
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))  # the run's byte tokenizer
    assert tokenizer("héllo\n", add_special_tokens=False).input_ids == list("héllo\n".encode())
    assert "generation_config.json" in printed and "bos_token_id=5, eos_token_id=7" in printed
    assert f"generation_config.json: copied from {str(llama_folder)!r}" in printed  # not "'...''s"


def test_a_byte_level_run_exports_a_byte_tokenizer_and_no_made_up_ids(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, d_ff=32, vocab_size=256, max_seq_len=32))
    checkpoint = save_checkpoint(model, tmp_path / "byte.ckpt")
    main(["export", "--ckpt_path", str(checkpoint), "--output", str(tmp_path / "hf")])
    printed = capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None  # not LlamaConfig's 1 and 2
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).config.eos_token_id is None
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "héllo wörld\n\t€"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids == list(text.encode()) and tokenizer.decode(ids) == text
    assert "byte tokenizer" in printed and "no BOS/EOS" in printed

    gone = tmp_path / "gone" / "tokenizer.json"
    main(["export", "--ckpt_path", str(save_checkpoint(model, tmp_path / "gone.ckpt", str(gone))),
          "--output", str(tmp_path / "hf2")])  # fmt: skip
    note = [line for line in capsys.readouterr().out.splitlines() if "tokenizer" in line and "not written" in line]
    assert len(note) == 1 and str(gone) in note[0] and not (tmp_path / "hf2" / "tokenizer.json").exists()
