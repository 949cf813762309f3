"""`lit3d prepare`: a corpus tokenized once into memory-mapped shards, and training read from them."""

import json

import numpy as np
import pytest
from helpers import fit, logged
from layouts import HALF, STEPS

from lit3d import GPT
from lit3d.cli import main
from lit3d.data import TextDataModule
from lit3d.data.prepared import PreparedBlocks
from lit3d.data.sources import load_documents
from lit3d.data.tokenizers import ByteTokenizer, tokenize_documents


@pytest.fixture
def prepared(text_folder, tmp_path, capsys):
    """The 6-document corpus in shards of 3,000 tokens, tokenized by 2 processes."""
    main(["prepare", "--data_path", str(text_folder), "--output", str(tmp_path / "prepared"), "--num_proc", "2",
          "--shard_tokens", "3000"])  # fmt: skip
    return tmp_path / "prepared", capsys.readouterr().out


def test_prepare_writes_every_document_in_order_and_reports_its_throughput(prepared, text_folder):
    folder, printed = prepared
    index = json.loads((folder / "index.json").read_text())
    stream = np.concatenate([np.fromfile(folder / s["file"], dtype=index["dtype"]) for s in index["shards"]])
    documents = load_documents(str(text_folder))["text"]
    expected = np.concatenate(tokenize_documents({"text": documents}, ByteTokenizer())["input_ids"])
    assert np.array_equal(stream, expected) and index["tokens"] == len(expected) and len(index["shards"]) > 2
    assert index["dtype"] == "uint16" and index["documents"] == 6
    assert "prepared 6 documents" in printed and "MB/s with 2 process(es)" in printed


def test_blocks_are_read_across_shard_boundaries(prepared):
    folder, _ = prepared
    blocks = PreparedBlocks(folder, 32, ByteTokenizer())
    index = json.loads((folder / "index.json").read_text())
    stream = np.concatenate([np.fromfile(folder / s["file"], dtype=index["dtype"]) for s in index["shards"]])
    assert len(blocks) == len(stream) // 32
    crossing = 3000 // 32  # block 93 spans tokens 2976..3007: the first shard's end and the second's start
    assert np.array_equal(blocks[crossing]["input_ids"].numpy(), stream[crossing * 32 : (crossing + 1) * 32])


def test_training_reads_a_prepared_folder(prepared, tmp_path):
    folder, _ = prepared
    data = TextDataModule(str(folder), seq_len=31, global_batch_size=4)
    trainer, log_dir = fit(GPT("tiny"), data, tmp_path / "run", max_steps=3)
    assert len(logged(log_dir, "train_loss")) == 3
    assert len(data.train_set) + len(data.val_set) + len(data.test_set) == len(
        PreparedBlocks(folder, 32, data.tokenizer)
    )


def test_a_prepared_folder_refuses_another_tokenizer_and_prepare_an_existing_output(prepared, text_folder, tmp_path):
    folder, _ = prepared
    data = TextDataModule(str(folder), seq_len=31, global_batch_size=4)
    data.tokenizer.fingerprint = "another"
    with pytest.raises(ValueError, match="was tokenized with tokenizer='byte', which is not this data module's"):
        data.setup("fit")
    with pytest.raises(SystemExit, match="exists and is not empty"):
        main(["prepare", "--data_path", str(text_folder), "--output", str(folder)])


def test_a_prepared_folder_mixes_with_other_sources_by_weight(prepared, tmp_path):
    folder, _ = prepared
    (tmp_path / "z.txt").write_text("z" * 40_000)
    data = TextDataModule({str(folder): 3, str(tmp_path / "z.txt"): 1}, seq_len=3, global_batch_size=4)
    blocks = data._packed_blocks()
    from_z = np.array([bool((blocks[i]["input_ids"] == ord("z")).all()) for i in range(len(blocks))])
    assert len(blocks) > 3000 and from_z.mean() == pytest.approx(0.25, abs=0.02)
    assert len(PreparedBlocks(folder, 4, data.tokenizer)) - (~from_z).sum() < 4  # it ends where the shards run out
    trainer, log_dir = fit(GPT("tiny"), data, tmp_path / "run", max_steps=2)
    assert len(logged(log_dir, "train_loss")) == 2


@pytest.fixture(scope="module")
def resumed_from_shards(base_job, corpus, tmp_path_factory) -> dict:
    """Training from prepared shards at DP2, checkpointed after step `HALF` (mid-epoch), and resumed on one process."""
    from conftest import dp2_then_resumed_on_one_process
    from layouts import merge

    out = tmp_path_factory.mktemp("prepared_runs")
    main(["prepare", "--data_path", str(corpus), "--output", str(out / "shards"), "--num_proc", "1"])
    base = merge(base_job, {"data": {"data_path": str(out / "shards")}, "trainer": {"limit_val_batches": 0}})
    return dp2_then_resumed_on_one_process(base, out)


def test_a_run_from_prepared_shards_resumes_mid_epoch_on_another_dp_size(resumed_from_shards):
    uninterrupted, resumed = resumed_from_shards["dp2"]["losses"], resumed_from_shards["resume_single"]["losses"]
    assert len(uninterrupted) == STEPS and len(resumed) == STEPS - HALF and uninterrupted[-1] < uninterrupted[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, uninterrupted[HALF:])) <= 1e-5
