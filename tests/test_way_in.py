"""The user's way in: a checkpoint of any layout read on one process, ``test``, ``predict``, ``lit3d convert`` and
``lit3d generate``, and fine-tuning a HuggingFace folder from the command line."""

import os
import subprocess
import sys
from pathlib import Path

import forked
import lightning as L
import pytest
import torch
from helpers import FORK, logged, tiny_llama
from layouts import SMALL_GPT, STEPS, VAL_BATCHES
from turns import turn

from lit3d import GPT, GPTConfig
from lit3d.checkpoint.folder import ShardedCheckpointReader
from lit3d.data import TextDataModule

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = "dp2_tp2_pp2_zero1"  # saves a checkpoint at its last step (tests/layouts.py)


def lit3d(*args: str, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return forked.run([sys.executable, str(ROOT / "cli.py"), *args], cwd=cwd, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def checkpoint(layout_runs) -> Path:
    return Path(layout_runs[LAYOUT]["job_dir"]) / "ckpts" / f"step={STEPS}.ckpt"


def one_process(**options) -> L.Trainer:
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(accelerator="cpu", devices=1, limit_val_batches=VAL_BATCHES, **quiet, **options)


def test_a_3d_checkpoint_validates_on_one_process_with_the_8_rank_val_loss(checkpoint, layout_runs, base_job, tmp_path):
    """Written by DP2 x TP2 x PP2; read whole under `auto`, by `load_from_checkpoint` and as a converted file."""
    from lit3d.cli import main

    expected = layout_runs[LAYOUT]["val_loss"][-1]  # validated after the last step, the checkpoint's step
    data = TextDataModule(**base_job["data"])
    trainer = one_process(plugins=[ShardedCheckpointReader()])
    by_trainer = trainer.validate(GPT(GPTConfig(**SMALL_GPT)), data, ckpt_path=str(checkpoint), verbose=False)
    by_module = one_process().validate(GPT.load_from_checkpoint(checkpoint), data, verbose=False)
    main(["convert", "--ckpt_path", str(checkpoint), "--output", str(tmp_path / "one.ckpt")])
    by_file = one_process().validate(GPT.load_from_checkpoint(tmp_path / "one.ckpt"), data, verbose=False)
    for result in (by_trainer, by_module, by_file):
        assert result[0]["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_test_reports_the_test_split_loss_and_perplexity_alike_in_every_layout(layout_runs, reference_run):
    single, split = reference_run["test"], layout_runs[LAYOUT]["test"]
    assert split["test_loss"] == pytest.approx(single["test_loss"], rel=1e-5)
    assert split["test_ppl"] == pytest.approx(torch.tensor(split["test_loss"]).exp().item(), rel=1e-5)


def test_predict_continues_each_prompt(base_job, capsys):
    data = TextDataModule(**{**base_job["data"], "prompts": ["the quick", "def"]})
    from lit3d.callbacks import PrintCompletions
    from lit3d.models.generation import Sampling

    model = GPT(GPTConfig(**SMALL_GPT), sampling=Sampling(max_new_tokens=5, temperature=0))
    predictions = one_process(callbacks=[PrintCompletions()]).predict(model, data)
    assert [len(p["completion"]) for p in predictions] == [5, 5]
    printed = capsys.readouterr().out
    assert "the quick" in printed and "def" in printed


def test_generate_prints_the_same_continuation_on_one_device_and_at_tp2(checkpoint, tmp_path, request):
    args = ["generate", "--ckpt_path", str(checkpoint), "--prompt", "the quick", "--max_new_tokens", "12",
            "--temperature", "1.0", "--seed", "3"]  # fmt: skip
    one = lit3d(*args, cwd=tmp_path)
    with turn(request.node.nodeid):  # (the two ranks only: `turns`)
        tp2 = lit3d(*args, "--devices", "2", "--accelerator", "cpu", cwd=tmp_path)
    assert one.returncode == 0 and tp2.returncode == 0, one.stderr[-2000:] + tp2.stderr[-2000:]
    text = one.stdout.strip().splitlines()[-1]
    assert text.startswith("the quick") and len(text) > len("the quick")
    assert tp2.stdout.strip().splitlines()[-1] == text


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A random tiny HuggingFace Llama over bytes (256 ids), saved as config.json + safetensors."""
    return tiny_llama(tmp_path_factory.mktemp("hf"))


def test_generate_from_a_huggingface_folder(hf_folder, tmp_path):
    run = lit3d("generate", "--ckpt_path", str(hf_folder), "--prompt", "def", "--max_new_tokens", "4", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1].startswith("def")


@pytest.mark.ranks
def test_finetuning_a_huggingface_folder_at_tp2_starts_from_its_loss(hf_folder, corpus, tmp_path):
    """`configs/finetune.yaml` at TP2: the first logged loss is the HuggingFace model's own on that batch."""
    from transformers import LlamaForCausalLM

    data_args = [f"--data.init_args.data_path={corpus}", "--data.init_args.seq_len=32",
                 "--data.init_args.global_batch_size=4"]  # fmt: skip
    run = lit3d("fit", "--config", str(ROOT / "configs" / "finetune.yaml"), f"--model.pretrained={hf_folder}",
                "--model.learning_rate=1e-3", "--trainer.max_steps=2", "--trainer.devices=2",
                "--trainer.strategy=Parallel3DStrategy", "--trainer.strategy.tensor_parallel_size=2", FORK,
                "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false", *data_args,
                cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    first = logged(tmp_path / "runs" / "finetune" / "version_0", "train_loss")[0]

    data = TextDataModule(data_path=str(corpus), seq_len=32, global_batch_size=4)
    data.setup("fit")
    data.data_parallel = (1, 0)
    batch = next(iter(data.train_dataloader()))["input_ids"]
    with torch.no_grad():
        logits = LlamaForCausalLM.from_pretrained(hf_folder).eval()(batch[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert first == pytest.approx(expected, rel=1e-5)
