"""Bad input on the `lit3d` command line ends in one line naming the value, before any rank starts: wrong strategy
arguments, layouts that do not fit the world or the model, and data the ranks could not read."""

import json
import os
import sys
from pathlib import Path

import forked
import pytest

ROOT = Path(__file__).resolve().parents[1]
FIT = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_steps=2",
       "--trainer.enable_progress_bar=false", "--data.init_args.seq_len=32", "--data.init_args.global_batch_size=4",
       "--trainer.enable_checkpointing=false", "--trainer.logger=false"]  # fmt: skip
STRATEGY = "--trainer.strategy=3d"
TP2_ON_2 = ["--trainer.devices=2", STRATEGY, "--trainer.strategy.tensor_parallel_size=2"]

# name -> (arguments after `lit3d fit --config configs/tiny.yaml ...`, the message its one line must hold)
CASES = {
    "zero_stage": ([STRATEGY, "--trainer.strategy.zero_stage=5"], "zero_stage=5 must be 0, 1, 2 or 3"),
    "schedule": (
        [STRATEGY, "--trainer.strategy.pipeline_schedule=foo"],
        "pipeline_schedule='foo' is not one of gpipe, 1f1b",
    ),
    "tp0": ([STRATEGY, "--trainer.strategy.tensor_parallel_size=0"], "tensor_parallel_size=0 must be a positive"),
    "tp_negative": ([STRATEGY, "--trainer.strategy.tensor_parallel_size=-2"], "tensor_parallel_size=-2 must be"),
    "zbv_zero3": (
        [
            "--trainer.devices=2",
            STRATEGY,
            "--trainer.strategy.pipeline_parallel_size=2",
            "--trainer.strategy.pipeline_schedule=zbv",
            "--trainer.strategy.zero_stage=3",
        ],
        "zero_stage=3 cannot run pipeline_schedule='zbv'",
    ),  # fmt: skip
    "tp3_on_4": (
        ["--trainer.devices=4", STRATEGY, "--trainer.strategy.tensor_parallel_size=3"],
        "tensor_parallel_size=3 x pipeline_parallel_size=1 does not divide the 4 launched ranks",
    ),
    "tp2_pp2_on_2": (
        [*TP2_ON_2, "--trainer.strategy.pipeline_parallel_size=2"],
        "tensor_parallel_size=2 x pipeline_parallel_size=2 does not divide the 2 launched ranks",
    ),
    "dp3_on_2": (
        ["--trainer.devices=2", STRATEGY, "--trainer.strategy.data_parallel_size=3"],
        "data_parallel_size=3 x tensor_parallel_size=1 x pipeline_parallel_size=1 = 3, but 2 ranks were launched",
    ),
    "tp4_tiny": (
        ["--trainer.devices=4", STRATEGY, "--trainer.strategy.tensor_parallel_size=4"],
        "tensor_parallel_size=4 does not divide n_kv_head=2",
    ),
    "cp2_seq_len": (
        ["--trainer.devices=2", STRATEGY, "--trainer.strategy.context_parallel_size=2", "--data.seq_len=102"],
        "seq_len=102 is not divisible by 2 x context_parallel_size=4",
    ),
    "missing_column": (
        [*TP2_ON_2, "--data.data_path=corpus.jsonl"],
        "'corpus.jsonl' has no column 'text' (its columns: ['id', 'body']); set text_column",
    ),
    "missing_column_one_process": (
        ["--data.data_path=corpus.jsonl"],
        "'corpus.jsonl' has no column 'text' (its columns: ['id', 'body']); set text_column",
    ),
    "other_tokenizer": (
        [*TP2_ON_2, "--data.data_path=prepared"],
        "'prepared' was tokenized with tokenizer='gpt2/tokenizer.json', which is not this data module's tokenizer",
    ),
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, dict]:
    """Every case run by `tests/cli_batch.py` in one process, where starting a rank fails loudly."""
    folder = tmp_path_factory.mktemp("refused")
    rows = [{"id": i, "body": f"document {i}: the quick brown fox " * 20} for i in range(40)]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "prepared").mkdir()  # `lit3d prepare`'s index, written with another tokenizer than the config's bytes
    index = {"format": "lit3d-tokens", "version": 1, "dtype": "uint16", "tokenizer": "gpt2/tokenizer.json",
             "tokenizer_fingerprint": "not-the-byte-tokenizer", "vocab_size": 50257, "documents": 0, "tokens": 0,
             "shards": []}  # fmt: skip
    (folder / "prepared" / "index.json").write_text(json.dumps(index))
    cases = [{"args": [*FIT, *args], "env": {}} for args, _ in CASES.values()]
    (folder / "cases.json").write_text(json.dumps(cases))
    run = forked.run([sys.executable, str(ROOT / "tests" / "cli_batch.py"), "cases.json", "results.json"],
                     cwd=folder, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return dict(zip(CASES, json.loads((folder / "results.json").read_text())))


@pytest.mark.parametrize("case", CASES)
def test_bad_input_ends_in_one_line_naming_the_value_before_any_rank_starts(refused, case):
    run, message = refused[case], CASES[case][1]
    last = (run["stderr"].strip().splitlines() or [""])[-1]
    assert run["code"] != 0 and not run["process_group"], run["stderr"][-3000:]
    assert last.startswith("lit3d fit: error: ") and message in last, run["stderr"][-3000:]
    assert "Traceback" not in run["stderr"] and "failed in step" not in run["stderr"], run["stderr"][-3000:]
