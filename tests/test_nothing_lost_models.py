"""Nothing lost, nothing silently wrong, between a run and its models: a checkpoint's tensors win over the folders its
run started from (every path that builds a model from it), a pretrained model is trained on its own tokenizer, and
an export carries every tokenizer file, the chat template included."""

import json
import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import CHATML, byte_level_bpe, chat_file, chat_tokenizer, tiny_llama

from lit3d import GPT, GPTConfig
from lit3d.checkpoint.folder import ShardedCheckpointReader
from lit3d.cli import main, make_cli
from lit3d.data import ChatDataModule, TextDataModule
from lit3d.errors import ConfigurationError
from lit3d.hf.adapters import read_adapter
from lit3d.models.generation import Sampling
from lit3d.strategies import Parallel3DStrategy

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
QUIET = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
READS_FOLDERS = dict(QUIET, plugins=[ShardedCheckpointReader()])  # `ckpt_path=` a checkpoint folder (as the CLI)
PROMPT = "the quick "


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    """A tiny HuggingFace Llama of 384 ids with its own tokenizer (a byte-level BPE of 306 ids)."""
    folder = tiny_llama(tmp_path_factory.mktemp("llama"), vocab_size=384)
    byte_level_bpe(["<s>", "</s>"]).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "fox.txt").write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 300))
    return folder


def text_data(corpus: Path, **kwargs) -> TextDataModule:
    return TextDataModule(str(corpus), **{"tokenizer": "byte", "seq_len": 32, "global_batch_size": 4,
                                          "test_fraction": 0.1, "prompts": [PROMPT], **kwargs})  # fmt: skip


def adapters(model: GPT) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.model.state_dict().items() if ".lora_" in name}


@pytest.fixture(scope="module")
def lora_run(corpus, tmp_path_factory) -> dict:
    """A LoRA run on a tiny Llama over bytes, started from a PEFT folder (its B not zero, as a trained adapter's),
    three steps under the 3D strategy on one process: its checkpoint folder, the folders it started from and what it
    trained."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    out = tmp_path_factory.mktemp("lora_run")
    llama_folder = tiny_llama(out / "llama")
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(LlamaForCausalLM.from_pretrained(llama_folder), config).save_pretrained(out / "peft")
    start = GPT(pretrained=str(llama_folder), adapter=str(out / "peft"))
    start.configure_model()
    model = GPT(pretrained=str(llama_folder), adapter=str(out / "peft"), learning_rate=3e-2, warmup_steps=0)
    trainer = L.Trainer(**QUIET, strategy=Parallel3DStrategy(), max_steps=3, num_sanity_val_steps=0,
                        limit_val_batches=0, default_root_dir=out)  # fmt: skip
    had_process_group = torch.distributed.is_initialized()
    trainer.fit(model, text_data(corpus))
    if not had_process_group:  # leave the test process as it was
        torch.distributed.destroy_process_group()
    (ckpt,) = (out / "checkpoints").iterdir()
    return dict(ckpt=ckpt, start=start, trained=adapters(model), folder=llama_folder, peft=out / "peft", out=out)


def test_load_from_checkpoint_gives_the_trained_adapters_as_export_writes_them_not_the_starting_ones(lora_run):
    from lit3d.cli.commands import convert, export

    start = adapters(lora_run["start"])
    assert all(not torch.equal(start[name], tensor) for name, tensor in lora_run["trained"].items() if "lora_b" in name)
    export(str(lora_run["ckpt"]), str(lora_run["out"] / "exported"), adapter=True)
    _, exported = read_adapter(lora_run["out"] / "exported", n_layer=2)
    convert(str(lora_run["ckpt"]), str(lora_run["out"] / "one.ckpt"))
    for checkpoint in (lora_run["ckpt"], lora_run["out"] / "one.ckpt"):  # the folder, and `lit3d convert`'s file
        loaded = adapters(GPT.load_from_checkpoint(checkpoint))
        assert loaded.keys() == lora_run["trained"].keys() == exported.keys()
        for name, tensor in lora_run["trained"].items():
            assert torch.equal(loaded[name], tensor) and torch.equal(exported[name], tensor), name


def test_generate_validate_test_and_predict_from_the_checkpoint_use_its_tensors(lora_run, corpus, capsys, tmp_path,
                                                                              monkeypatch):  # fmt: skip
    """Each path from the checkpoint computes what the trained model computes, not what the start computes."""
    monkeypatch.chdir(tmp_path)  # (where `lit3d validate` writes its config.yaml)
    trained = GPT.load_from_checkpoint(lora_run["ckpt"], sampling=Sampling(max_new_tokens=12, temperature=0))
    start = lora_run["start"]
    prompt = torch.tensor([list(PROMPT.encode())])
    with torch.no_grad():
        logits = trained(prompt)
        assert not torch.allclose(logits, start(prompt), atol=1e-4)
        pretrained = GPT(pretrained=str(lora_run["ckpt"]))  # how `lit3d generate` builds it: no LoRA, merged
        pretrained.configure_model()
        torch.testing.assert_close(pretrained(prompt), logits, atol=1e-5, rtol=0)
    continuation = trained.generate(prompt)[0].tolist()
    main(["generate", "--ckpt_path", str(lora_run["ckpt"]), "--prompt", PROMPT, "--max_new_tokens", "12",
          "--temperature", "0"])  # fmt: skip
    assert capsys.readouterr().out.strip().splitlines()[-1] == bytes(continuation).decode("utf-8", errors="replace")

    from_start = lambda: GPT(pretrained=str(lora_run["folder"]), adapter=str(lora_run["peft"]),
                             sampling=Sampling(max_new_tokens=12, temperature=0))  # fmt: skip
    expected = {}
    for stage in ("validate", "test"):
        expected[stage] = getattr(L.Trainer(**QUIET), stage)(trained, text_data(corpus), verbose=False)[0]
        got = getattr(L.Trainer(**READS_FOLDERS), stage)(from_start(), text_data(corpus), ckpt_path=lora_run["ckpt"],
                                                         verbose=False)  # fmt: skip
        assert got[0] == pytest.approx(expected[stage], rel=1e-6)
    predicted = L.Trainer(**READS_FOLDERS).predict(from_start(), text_data(corpus), ckpt_path=lora_run["ckpt"])
    assert predicted[0]["prompt"].tolist() + predicted[0]["completion"].tolist() == continuation

    cli = make_cli(["validate", "--config", str(ROOT / "configs" / "lora.yaml"), "--trainer.logger=false",
                    f"--model.pretrained={lora_run['folder']}", f"--model.adapter={lora_run['peft']}",
                    "--model.lora=null",  # (the adapter's settings, not the config's)
                    f"--data.init_args.data_path={corpus}", "--data.init_args.tokenizer=byte",
                    "--data.init_args.seq_len=32", "--data.init_args.global_batch_size=4",
                    "--data.init_args.test_fraction=0.1", f"--ckpt_path={lora_run['ckpt']}"])  # fmt: skip
    assert float(cli.trainer.callback_metrics["val_loss"]) == pytest.approx(expected["validate"]["val_loss"], rel=1e-6)


def one_step(tmp_path) -> list[str]:
    """Flags of a one-step fit that saves its checkpoint (the config's ModelCheckpoint, every step) in ``tmp_path``."""
    return ["--data.init_args.global_batch_size=2", "--trainer.max_steps=1",
            "--trainer.callbacks.every_n_train_steps=1", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}"]  # fmt: skip


def test_lora_yaml_on_a_pretrained_folder_tokenizes_with_the_folders_tokenizer(llama_folder, corpus, tmp_path,
                                                                               monkeypatch, caplog):  # fmt: skip
    """The issue's command: no tokenizer given, the folder's own is used (and said), and the checkpoint records it."""
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO):
        cli = make_cli(
            [
                "fit",
                "--config",
                str(ROOT / "configs" / "lora.yaml"),
                f"--model.pretrained={llama_folder}",
                f"--data.init_args.data_path={corpus}",
                "--data.init_args.seq_len=32",
                *one_step(tmp_path),
            ]
        )
    own = str(llama_folder / "tokenizer.json")
    batch = next(iter(cli.datamodule.train_dataloader()))["input_ids"]
    assert cli.datamodule.vocab_size == 306 and batch.max() >= 256  # BPE merges: ids a byte tokenizer never gives
    (ckpt,) = tmp_path.rglob("epoch=*.ckpt")  # the config's ModelCheckpoint, saving after every step
    assert torch.load(ckpt, weights_only=True)["datamodule_hyper_parameters"]["tokenizer"] == own
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tokenizer: ")]
    assert len(said) == 1 and own in said[0] and "pretrained folder" in said[0], said


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_any_rank_starts(llama_folder, corpus,
                                                                                          tmp_path):  # fmt: skip
    small = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, d_ff=32, vocab_size=256, max_seq_len=32))
    for tokenizer in (str(llama_folder), str(llama_folder / "tokenizer.json")):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=Parallel3DStrategy(start_method="fork"),
                            logger=False, max_steps=1, default_root_dir=tmp_path)  # fmt: skip
        with pytest.raises(ConfigurationError, match=r"the tokenizer has 306 ids but the model's vocab_size=256"):
            trainer.fit(small, text_data(corpus, tokenizer=tokenizer))


def test_chat_data_takes_the_pretrained_folder_or_its_tokenizer_json(llama_folder, tmp_path):
    """``tokenizer=`` the folder or its tokenizer.json alike; by default the pretrained model's folder."""
    model_folder = tiny_llama(tmp_path / "model", vocab_size=320)
    chat_tokenizer(model_folder, template=None)
    (model_folder / "chat_template.jinja").write_text(CHATML)  # where transformers 5 keeps it
    chats = chat_file(tmp_path / "chats.jsonl", 24, max_words=8)
    rows = lambda data: data.train_set.input_ids
    by_folder = ChatDataModule(str(chats), str(model_folder), seq_len=64, global_batch_size=2)
    by_file = ChatDataModule(str(chats), str(model_folder / "tokenizer.json"), seq_len=64, global_batch_size=2)
    assert (rows(by_file) == rows(by_folder)).all()
    by_default = ChatDataModule(str(chats), seq_len=64, global_batch_size=2)
    trainer = L.Trainer(**QUIET, max_steps=1, limit_val_batches=0, enable_checkpointing=False)
    trainer.fit(GPT(pretrained=str(model_folder)), by_default)
    assert by_default.tokenizer_name == str(model_folder / "tokenizer.json")
    assert (rows(by_default) == rows(by_folder)).all()


def test_the_merged_export_of_a_chat_run_keeps_the_chat_template(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    model_folder = tiny_llama(tmp_path / "model", vocab_size=320)
    chat_tokenizer(model_folder, template=None)
    (model_folder / "chat_template.jinja").write_text(CHATML)  # where transformers 5 keeps it
    chats = chat_file(tmp_path / "chats.jsonl", 24, max_words=8)
    monkeypatch.chdir(tmp_path)
    make_cli(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "chat.yaml"),
            f"--model.pretrained={model_folder}",
            f"--data.init_args.tokenizer={model_folder}",
            f"--data.init_args.data_path={chats}",
            "--data.init_args.seq_len=64",
            *one_step(tmp_path),
        ]
    )
    (ckpt,) = tmp_path.rglob("epoch=*.ckpt")
    main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "merged")])
    assert (tmp_path / "merged" / "chat_template.jinja").read_text() == CHATML
    turns = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "yes"}]
    ours, theirs = (AutoTokenizer.from_pretrained(folder) for folder in (tmp_path / "merged", model_folder))
    rendered = ours.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert rendered == theirs.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>user\nwhy<|im_end|>\n")
