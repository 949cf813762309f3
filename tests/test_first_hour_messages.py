"""What a newcomer reads in the first hour (issue 47, items 5 to 15): mistakes refused early in one line that names
the value and what would be right, the command line's conventions (``--version``, usage lines, quick help), generation
that speaks the model's chat format, and output without Lightning's noise."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import chat_file, chat_tokenizer, tiny_llama
from lightning.pytorch.callbacks import ModelCheckpoint

import lit3d
from lit3d import GPT
from lit3d.cli import main
from lit3d.data import ChatDataModule, TextDataModule

ROOT = Path(__file__).resolve().parents[1]
QUIET = dict(
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    limit_val_batches=0,
    num_sanity_val_steps=0,
)


def lit3d_command(*args: str, cwd: Path, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    env.pop("HF_DATASETS_DISABLE_PROGRESS_BARS", None)  # (the suite's; a user's run has none)
    return subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def refusal(args: list[str]) -> str:
    """The one line ``lit3d ARGS`` ends with."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    return str(exit_.value.code)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A tiny HuggingFace Llama with a ChatML tokenizer folder (its chat template beside it)."""
    folder = tmp_path_factory.mktemp("chat_model") / "model"
    chat_tokenizer(folder)
    return tiny_llama(folder, vocab_size=320)


# ---------------------------------------------------------------- 5, 6: bad data, refused before anything starts


def chat_fit(model: Path, chats: Path, *more: str) -> list[str]:
    """``lit3d fit``'s arguments: two steps of ``model`` on the chat file ``chats`` (sequences of 64, batch 8)."""
    return [
        "fit",
        "--model.class_path=lit3d.GPT",
        f"--model.init_args.pretrained={model}",
        "--data.class_path=lit3d.data.ChatDataModule",
        f"--data.init_args.data_path={chats}",
        "--data.init_args.seq_len=64",
        "--data.init_args.global_batch_size=8",
        "--trainer.max_steps=2",
        *more,
    ]


def test_a_chat_held_out_set_smaller_than_one_round_of_micro_batches_is_refused_before_any_rank_starts(
    chat_model, tmp_path, monkeypatch
):
    """Item 5: 40 examples hold out 2 (5 %), packed into a row or two, but a round of micro-batches takes 8 (global
    batch 8, no accumulation, in every layout): refused with the training split, not after the model summary, and
    nothing is written under ``runs/``."""
    monkeypatch.chdir(tmp_path)
    chats = chat_file(tmp_path / "chats.jsonl", 40, max_words=10)
    line = refusal(chat_fit(chat_model, chats, "--trainer.default_root_dir=runs"))
    held = re.match(
        rf"lit3d fit: error: the validation set of {re.escape(repr(str(chats)))} holds (\d+) sequences, ", line
    )
    assert held is not None and int(held[1]) < 8, line
    assert "global_batch_size=8 / accumulate_grad_batches=1 = 8" in line and "hold out more (val_fraction" in line
    assert not (tmp_path / "runs").exists()


def test_too_few_training_rows_and_too_small_a_validation_set_are_refused_together(chat_model, tmp_path, monkeypatch):
    """Issue 63, item 10: a chat file too small for its global batch AND its validation round gets one refusal naming
    both, not one and then, once that is mended, the other."""
    monkeypatch.chdir(tmp_path)
    chats = chat_file(tmp_path / "chats.jsonl", 6, max_words=10)
    line = refusal(chat_fit(chat_model, chats, "--data.init_args.packing=false"))
    assert line.count("\n") == 0 and line.startswith("lit3d fit: error: the 4 training examples of "), line
    assert "fewer than global_batch_size=8; and the validation set of" in line, line
    assert "global_batch_size=8 / accumulate_grad_batches=1 = 8" in line, line
    assert not (tmp_path / "lightning_logs").exists()


def test_a_malformed_json_line_is_refused_naming_its_file_and_line(chat_model, tmp_path):
    """Item 6: chat data, text data (the first lines are read before training), and a line past those (found where
    `datasets` fails on the file)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "why", "response": "yes"}\n{"prompt": "how", "response": }\n')
    with pytest.raises(ValueError, match=re.escape(f"{bad}, line 2, column 31: not valid JSON (Expecting value)")):
        ChatDataModule(str(bad), str(chat_model), seq_len=64, global_batch_size=1)
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "the quick fox"}\n{"text": "lazy", }\n')
    with pytest.raises(ValueError, match=re.escape(f"{texts}, line 2, column 18: not valid JSON")):
        TextDataModule(str(texts), seq_len=16, global_batch_size=1)
    late = tmp_path / "late.jsonl"
    late.write_text('{"text": "the quick brown fox"}\n' * 1200 + '{"text": "the end\n')
    from lit3d.data.sources import load_documents

    with pytest.raises(ValueError, match=re.escape(f"{late}, line 1201, column 10: not valid JSON")):
        load_documents(str(late), cache_dir=str(tmp_path / "cache"))


# ---------------------------------------------------------------- 7: strategy names


@pytest.mark.parametrize(
    "given, guess",
    [
        (["--trainer.strategy=Parallel3D", "--trainer.strategy.tensor_parallel_size=2"], "Parallel3DStrategy"),
        (["--trainer.strategy", "Parallel3D"], "Parallel3DStrategy"),
        (["--trainer.strategy=dpp"], "ddp"),
    ],
)
def test_a_strategy_name_that_names_nothing_is_refused_with_lit3d_s_names_and_the_closest(given, guess):
    """Item 7: not jsonargparse's dump of its parser (with a ``--trainer.strategy.*`` argument) nor Lightning's
    lower-cased name with four of its own choices."""
    line = refusal(["fit", *given])
    name = given[0].partition("=")[2] or given[1]
    assert line.startswith(f"lit3d fit: error: trainer.strategy={name!r} names no strategy: did you mean {guess!r}?")
    assert "lit3d registers 3d, Parallel3DStrategy, 3d_auto (lit3d.strategies.Parallel3DStrategy" in line
    assert "Lightning: auto, ddp, ddp_spawn, deepspeed, fsdp" in line and "NestedArg" not in line


def test_a_config_s_strategy_name_that_names_nothing_is_refused_alike(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("trainer:\n  strategy: parallel3d\n  logger: false\n")
    line = refusal(["fit", "--config", "run.yaml"])
    assert line.startswith("lit3d fit: error: trainer.strategy='parallel3d' names no strategy: did you mean ")


# ---------------------------------------------------------------- misspelt keys (issue 63, item 11)


@pytest.mark.parametrize(
    "given, meant",
    [("--model.init_args.learning_rat=0.1", "--model.init_args.learning_rate"),
     ("--model.learning_rat=0.1", "--model.learning_rate"),
     ("--data.init_args.seq_lenn=32", "--data.init_args.seq_len"),
     ("--model.init_args.config.n_layr=2", "--model.init_args.config.n_layer"),
     ("--trainer.max_stepz=3", "--trainer.max_steps"),
     ("--trainer.strategy.zero_stag=1", "--trainer.strategy.zero_stage")],
)  # fmt: skip
def test_a_misspelt_argument_is_refused_in_one_line_with_the_nearest_accepted_name(given, meant, capsys):
    """Not the command's 45 lines of usage and jsonargparse's error for each type the section could be."""
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", "tiny", "--trainer.strategy=3d", given])
    said = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage:" not in said and "Union" not in said, said
    typed = given.partition("=")[0]
    assert said.splitlines()[-1] == f"lit3d fit: error: unknown argument {typed}: did you mean {meant}?"


@pytest.mark.parametrize(
    "yaml, line",
    [("trainer:\n  max_stepz: 3\n", "unknown key trainer.max_stepz in the config: did you mean trainer.max_steps?"),
     ("data:\n  init_args:\n    seq_lenn: 32\n",
      "unknown key 'seq_lenn' of data (lit3d.data.TextDataModule) in the config: did you mean 'seq_len'?")],
)  # fmt: skip
def test_a_misspelt_config_key_is_refused_alike(yaml, line, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(yaml)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", "tiny", "--config", "run.yaml"])
    said = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage:" not in said and said.splitlines()[-1] == f"lit3d fit: error: {line}"


# ---------------------------------------------------------------- 8: a lit3d folder under another strategy


@pytest.fixture
def lit3d_folder(small_config, text_folder, tmp_path) -> Path:
    """A lit3d checkpoint folder (as `Parallel3DStrategy` writes) of a small GPT trained 2 steps by one process."""
    from lit3d.strategies import Parallel3DStrategy

    saving = ModelCheckpoint(dirpath=tmp_path / "one", every_n_train_steps=2)
    data = TextDataModule(str(text_folder), seq_len=16, global_batch_size=4)
    L.Trainer(max_steps=2, callbacks=[saving], **QUIET).fit(GPT(small_config), data)
    checkpoint = torch.load(tmp_path / "one" / "epoch=0-step=2.ckpt", weights_only=False)
    folder = tmp_path / "step=2.ckpt"
    Parallel3DStrategy().save_checkpoint({**checkpoint, "optimizer_states": []}, folder)
    return folder


def test_resuming_a_lit3d_folder_under_another_strategy_says_it_is_one_and_how_to_go_on(
    lit3d_folder, small_config, text_folder, tmp_path, monkeypatch
):
    """Item 8: not Lightning's "checkpoint contains only the model ... save_weights_only"; the command line refuses it
    before any rank starts."""
    from lit3d.checkpoint.folder import ShardedCheckpointReader

    data = TextDataModule(str(text_folder), seq_len=16, global_batch_size=4)
    trainer = L.Trainer(max_steps=3, plugins=[ShardedCheckpointReader()], enable_checkpointing=False, **QUIET)
    with pytest.raises(ValueError) as error:
        trainer.fit(GPT(small_config), data, ckpt_path=str(lit3d_folder))
    said = str(error.value)
    assert said.startswith(f"{str(lit3d_folder)!r} is a lit3d checkpoint folder: its optimizer states resume only ")
    assert "--trainer.strategy=3d" in said and f"lit3d convert --ckpt_path {lit3d_folder}" in said
    assert f"--model.pretrained={lit3d_folder}" in said and "save_weights_only" not in said
    monkeypatch.chdir(tmp_path)
    line = refusal(
        ["fit", f"--data.init_args.data_path={text_folder}", "--trainer.logger=false", f"--ckpt_path={lit3d_folder}"]
    )
    assert line.startswith(f"lit3d fit: error: {str(lit3d_folder)!r} is a lit3d checkpoint folder")
    assert "Under SingleDeviceStrategy, start from its weights" in line


# ---------------------------------------------------------------- 9, 13: generate


def test_generate_on_a_folder_without_a_tokenizer_asks_for_one(tmp_path):
    """Item 9: not bytes' "bytes must be in range(0, 256)" once the model says id 300."""
    folder = tiny_llama(tmp_path / "no_tokenizer", vocab_size=320)
    line = refusal(["generate", "--ckpt_path", str(folder), "--prompt", "hi"])
    assert line.startswith(f"lit3d generate: error: {str(folder)!r} names no tokenizer")
    assert "vocab_size=320 is more than the byte tokenizer's 256 ids: give --tokenizer" in line


def scripted_chat_model(folder: Path) -> list[int]:
    """A tiny Llama with a ChatML tokenizer that answers any conversation greedily with "yes", then its end of turn,
    then "no" (its blocks add nothing; each token's embedding points the output head at the next); the ids of the
    answer's tokens: yes, <|im_end|>, no."""
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from lit3d.data.chat_template import ChatTemplate

    chat_tokenizer(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = ChatTemplate(folder).render([{"role": "user", "content": "why"}], add_generation_prompt=True)
    last = tokenizer.encode(text, add_special_tokens=False).ids[-1]
    yes, no = tokenizer.encode("yes").ids[0], tokenizer.encode("no").ids[0]
    end = tokenizer.token_to_id("<|im_end|>")
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=tokenizer.get_vocab_size(),
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for axis, (token, following) in enumerate([(last, yes), (yes, end), (end, no)]):
            embed[token] = torch.nn.functional.one_hot(torch.tensor(axis), 32).float()
            head[following] = embed[token]
    model.save_pretrained(folder)
    return [yes, end, no]


@pytest.mark.parametrize(
    "prompt", [["--prompt", "why", "--chat"], ["--prompt", '[{"role": "user", "content": "why"}]']]
)
def test_generate_chat_applies_the_folder_s_template_and_stops_at_the_end_of_the_turn(
    prompt, tmp_path, capsys, monkeypatch
):
    """Item 13: ``--chat`` (or a conversation as the prompt) renders the prompt with the folder's chat template and
    its generation prompt; generation stops at ``<|im_end|>`` (of 8 tokens allowed, 2 are made) and the answer alone
    is printed."""
    from tokenizers import Tokenizer

    yes, end, _ = scripted_chat_model(tmp_path / "model")
    made = []
    generate = GPT.generate

    def recording(self, prompt_tokens, sampling=None, generator=None):
        tokens = generate(self, prompt_tokens, sampling, generator)
        made.append(tokens[0, prompt_tokens.shape[-1] :].tolist())
        return tokens

    monkeypatch.setattr(GPT, "generate", recording)
    main(["generate", "--ckpt_path", str(tmp_path / "model"), *prompt, "--temperature", "0", "--max_new_tokens", "8"])
    assert made == [[yes, end]]
    answer = Tokenizer.from_file(str(tmp_path / "model" / "tokenizer.json")).decode([yes])
    assert capsys.readouterr().out == answer + "\n"


def test_generate_continues_plain_text_past_the_end_of_turn_token(tmp_path, capsys):
    """Without ``--chat`` the prompt is text to continue, printed with its continuation, and nothing stops early."""
    yes, end, no = scripted_chat_model(tmp_path / "model")
    template_end = "<|im_start|>assistant\n"
    main(
        [
            "generate",
            "--ckpt_path",
            str(tmp_path / "model"),
            "--prompt",
            f"<|im_start|>user\nwhy<|im_end|>\n{template_end}",
            "--temperature",
            "0",
            "--max_new_tokens",
            "3",
        ]
    )
    assert capsys.readouterr().out.startswith("user\nwhy\nassistant\nyes")


# ---------------------------------------------------------------- 10: conventions


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_lit3d_version_prints_the_one_version_the_package_has(flag, capsys):
    main([flag])
    printed = capsys.readouterr().out
    assert printed.startswith(f"lit3d {lit3d.__version__} (Python ") and "torch " in printed
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lit3d.__version__"}
    major_minor = ".".join(lit3d.__version__.split(".")[:2])
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:  # "lit3d 0.1's" names an old one
        claims = re.findall(r"\blit3d (?:version )?v?(\d+\.\d+)(?:\.\d+)?(?!\d|'s)", page.read_text())
        assert all(claim == major_minor for claim in claims), (page.name, claims)


def test_every_command_s_usage_names_it_and_export_names_every_family(capsys):
    for command in ("export", "convert", "generate", "prepare", "calibrate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        help_text = capsys.readouterr().out
        assert help_text.startswith(f"usage: lit3d {command} ["), help_text[:80]
        if command == "export":
            assert "HuggingFace Llama folder" not in help_text and "Qwen3" in help_text and "Mistral" in help_text
    main(["--help"])
    assert "HuggingFace Llama folder" not in capsys.readouterr().out


# ---------------------------------------------------------------- 11: quiet, exact output


@pytest.mark.ranks
def test_a_tiny_3d_fit_prints_the_rank_map_the_plan_and_the_samples_and_none_of_lightning_s_noise(tmp_path):
    """Item 11: what a newcomer's first run prints, rank 0 and rank 1 together."""
    run = lit3d_command(
        "fit",
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        "--trainer.devices=2",
        "--trainer.strategy=3d",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        "--data.init_args.global_batch_size=4",
        cwd=tmp_path,
    )
    printed = run.stdout + run.stderr
    assert run.returncode == 0, printed[-3000:]
    for kept in (
        "lit3d layout: 2 ranks = dp 2 x tp 1 x pp 1",
        "lit3d plan estimate for rank 0",
        "--- sample at step 2",
        "Trainable params",
        "Epoch 0 ",
    ):
        assert kept in printed, kept
    for noise in (
        "💡 Tip",
        "litlogger",
        "litmodels",
        "LeafSpec",
        "Total FLOPs",
        "FLOPs",
        "Downloading data",
        "Generating train split",
        "weights_only",
        "Epoch 0/-2",
    ):
        assert noise not in printed, (noise, printed[-3000:])


def test_a_full_save_does_not_log_that_weights_only_was_not_set(small_config, text_folder, tmp_path, caplog):
    """Item 11: preemption saves call ``trainer.save_checkpoint(path)`` (a full checkpoint, resumable), and Lightning
    logged "`weights_only` was not set" for each; any other line of the same logger still shows."""
    from lit3d.quiet import quiet_lightning

    quiet_lightning()
    trainer = L.Trainer(max_steps=1, enable_checkpointing=False, **QUIET)
    trainer.fit(GPT(small_config), TextDataModule(str(text_folder), seq_len=16, global_batch_size=4))
    with caplog.at_level(logging.INFO):
        trainer.save_checkpoint(tmp_path / "preempted.ckpt")
        logging.getLogger("lightning.pytorch.trainer.connectors.checkpoint_connector").info("another line")
    assert "weights_only" not in caplog.text and "another line" in caplog.text
    assert (tmp_path / "preempted.ckpt").is_file()


def test_after_a_mid_epoch_resume_the_bar_counts_the_epoch_s_batches_of_its_total(small_config, text_folder, tmp_path):
    """Item 11: Lightning's bar counted the epoch's batches from its start (60) against the batches left (26)."""
    from lit3d.callbacks import RichProgress

    def fit(max_steps, ckpt_path=None):
        bar = RichProgress(leave=True)
        saving = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
        data = TextDataModule(str(text_folder), seq_len=16, global_batch_size=4)
        options = {**QUIET, "enable_progress_bar": True}
        L.Trainer(max_steps=max_steps, callbacks=[saving, bar], **options).fit(
            GPT(small_config), data, ckpt_path=ckpt_path
        )
        (task,) = [task for task in bar.progress.tasks if task.id == bar.train_progress_bar_id]
        return task.completed, task.total

    assert fit(3) == (3, 3)
    assert fit(5, ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt")) == (5, 5)


class Lines(logging.Handler):
    """The messages logged to the loggers it is attached to."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_calibrate_s_timing_fit_logs_nothing_of_lightning_s():
    """Item 11: ``lit3d calibrate`` times Lightning's loop with a fit, but not one the user ran: Lightning's info lines
    (devices, tips, "`Trainer.fit` stopped") are left out, its warnings would show."""
    from lit3d.planner.calibrate import measure_step_overhead

    lines = Lines()
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    for logger in loggers:
        logger.addHandler(lines)
    try:
        assert measure_step_overhead(steps=2) > 0
    finally:
        for logger in loggers:
            logger.removeHandler(lines)
    assert lines.messages == [], lines.messages


def test_reading_local_files_shows_no_download_progress(text_folder, tmp_path):
    """Item 11: `datasets`' "Downloading data" and "Generating train split" bars, for files already here."""
    probe = f"from lit3d.data.sources import load_documents; load_documents({str(text_folder)!r}, cache_dir='cache')"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HF_DATASETS_DISABLE_PROGRESS_BARS", None)  # (the suite's)
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Downloading data" not in run.stderr and "Generating train split" not in run.stderr, run.stderr


# ---------------------------------------------------------------- 12: checkpoint paths in the docs


def written_checkpoints(config: Path, max_steps: set[int]) -> set[str]:
    """The checkpoint paths a ``lit3d fit`` of ``config`` writes at its end (after one of ``max_steps``), as its
    ModelCheckpoints name them: ``last.ckpt`` with ``save_last``, else their own file names, at any epoch."""
    import yaml

    trainer = yaml.safe_load(config.read_text()).get("trainer") or {}
    written = set()
    for callback in trainer.get("callbacks") or []:
        if not callback["class_path"].endswith("ModelCheckpoint"):
            continue
        arguments = callback.get("init_args") or {}
        saving = ModelCheckpoint(**arguments)
        logger = (trainer.get("logger") or {}).get("init_args") or {}
        default = f"{logger.get('save_dir', 'lightning_logs')}/{logger.get('name', '')}/version_0/checkpoints"
        folder = Path(arguments.get("dirpath") or default)  # (ModelCheckpoint keeps it absolute)
        if saving.save_last:
            written.add(str(folder / f"{saving.CHECKPOINT_NAME_LAST}{saving.FILE_EXTENSION}"))
        for steps in max_steps:
            for epoch in range(100):
                written.add(str(folder / Path(saving.format_checkpoint_name({"epoch": epoch, "step": steps})).name))
    return written


def quoted_checkpoints(text: str) -> list[str]:
    """The checkpoint paths a page quotes: ``runs/.../x.ckpt``, in any command or line (a file name alone, such as
    ``preempted-step=N.ckpt``, names a kind of file, not one a config writes)."""
    return re.findall(r"(?<![\w/.-])((?:[\w.-]+/)+[\w.=-]+\.ckpt)\b", text)


def page_configs(text: str) -> dict[Path, set[int]]:
    """The configs a page's commands use (``--config configs/X.yaml`` or a shipped name), each with the ``max_steps``
    its runs end at (the config's own, and any ``--trainer.max_steps`` a command of the page gives with it)."""
    import yaml

    from lit3d.shipped import find_config

    configs: dict[Path, set[int]] = {}
    for line in text.splitlines():
        for name in re.findall(r"--config[= ](\S+)", line):
            path = ROOT / name if (ROOT / name).is_file() else find_config(name)
            if path is None:
                continue
            steps = configs.setdefault(path, {(yaml.safe_load(path.read_text()).get("trainer") or {})["max_steps"]})
            steps.update(int(s) for s in re.findall(r"--trainer\.max_steps[= ](\d+)", line))
    return configs


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_checkpoint_path_the_docs_quote_is_one_a_config_they_quote_writes(page):
    """Item 12: ``runs/lora/version_0/checkpoints/last.ckpt`` was quoted where ``configs/lora.yaml`` writes
    ``runs/lora/checkpoints/last.ckpt``."""
    text = page.read_text()
    written = set()
    for config, steps in page_configs(text).items():
        written |= written_checkpoints(config, steps)
    for quoted in quoted_checkpoints(text):
        assert quoted in written, f"{page.name} quotes {quoted}, which no config it uses writes"


def test_the_docs_quote_checkpoints_and_a_wrong_one_is_caught():
    quoted = quoted_checkpoints((ROOT / "docs" / "checkpoints-and-hf.md").read_text())
    assert "runs/tiny/checkpoints/epoch=0-step=600.ckpt" in quoted
    lora = (ROOT / "docs" / "fine-tuning.md").read_text()
    assert "runs/lora/checkpoints/last.ckpt" in quoted_checkpoints(lora)
    written = set().union(*(written_checkpoints(c, s) for c, s in page_configs(lora).items()))
    assert "runs/lora/checkpoints/last.ckpt" in written
    assert "runs/lora/version_0/checkpoints/last.ckpt" not in written


# ---------------------------------------------------------------- 14: help in about a second


def test_help_asked_again_is_answered_without_loading_torch(tmp_path):
    """Item 14: the first answer loads Lightning and torch (seconds, up to 20 on a busy machine) and is kept; the same
    question again prints the same text from the cache, importing neither."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    first = lit3d_command("fit", "--data.help", "lit3d.data.TextDataModule", cwd=tmp_path, env=env)
    assert first.returncode == 0 and "--data.seq_len" in first.stdout, first.stderr[-2000:]
    probe = (
        "import sys, time; from lit3d.cli import main\nstart = time.perf_counter()\n"
        "try:\n    main(['fit', '--data.help', 'lit3d.data.TextDataModule'])\nexcept SystemExit as e:\n"
        "    assert e.code == 0\n"
        "print('seconds', time.perf_counter() - start, 'torch' in sys.modules, 'lightning' in sys.modules)"
    )
    again = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )
    assert again.returncode == 0, again.stderr[-2000:]
    text, summary = again.stdout.rsplit("seconds ", 1)
    seconds, torch_loaded, lightning_loaded = summary.split()
    assert text == first.stdout and torch_loaded == lightning_loaded == "False"
    assert float(seconds) < 1.0
    from lit3d.cli.help_cache import cache_file

    assert cache_file(["fit", "--model.help", "mypackage.MyModel"]) is None  # its source could change unseen
    assert cache_file(["fit", "--data.help", "lit3d.data.TextDataModule"]) is not None


# ---------------------------------------------------------------- 15: expert parallelism drawn


def test_the_rank_map_picture_names_each_rank_s_share_of_the_experts():
    """Item 15: with ``expert_parallel_size=2`` over dp 4, ranks d0, d1 form one expert group (e0, e1) and d2, d3 the
    other, which holds the same experts."""
    pytest.importorskip("matplotlib")
    from lit3d.parallel.layout import Layout
    from lit3d.planner.rankmap import RankMap

    figure = RankMap(Layout(dp=4, tp=2, pp=1, devices_per_node=8, ep=2)).figure()
    (axes,) = figure.axes
    labels = [text.get_text().replace("\n", " ") for text in axes.texts]
    assert labels[:4] == ["r0 t0 p0 d0 e0", "r1 t1 p0 d0 e0", "r2 t0 p0 d1 e1", "r3 t1 p0 d1 e1"]
    assert labels[4:6] == ["r4 t0 p0 d2 e0", "r5 t1 p0 d2 e0"]
    title = axes.get_title()
    assert "dp 4 (ep 2 within dp) x tp 2" in title
    assert "expert-parallel groups of 2 consecutive d (ranks 2 apart); the 2 groups hold the same experts" in title
    dense = RankMap(Layout(dp=4, tp=2, pp=1, devices_per_node=8)).figure().axes[0]
    assert " e0" not in dense.texts[0].get_text() and "expert" not in dense.get_title()
