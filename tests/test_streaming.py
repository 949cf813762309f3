"""Streaming: sources read as training goes, global batches that do not depend on the layout, exact resume."""

import itertools
import json
from collections import Counter

import numpy as np
import pytest
from helpers import fit, logged
from layouts import HALF, STEPS

from lit3d import GPT
from lit3d.data import TextDataModule, streaming

DOCUMENTS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 4 + 1) for i in range(30)]


@pytest.fixture
def jsonl_corpus(tmp_path):
    """30 documents of different lengths in two JSONL files and a text file: 26 global batches of 8 x 17 bytes."""
    for part in range(2):
        rows = DOCUMENTS[part * 10 : (part + 1) * 10]
        (tmp_path / f"part{part}.jsonl").write_text("".join(json.dumps({"body": t, "id": 1}) + "\n" for t in rows))
    (tmp_path / "rest.txt").write_text("\n".join(DOCUMENTS[20:]))
    return tmp_path


def stream(data: TextDataModule, replicas: int, rank: int, resume=None):
    data.data_parallel, data._resume = (replicas, rank), ({"stream": resume} if resume else None)
    data.setup("fit")
    return iter(data._stream_loader().dataset)


def global_batches(data, replicas: int, n: int) -> list[list[tuple]]:
    """The first ``n`` global batches as every replica reads them, each block as a tuple, with its tag."""
    G = data.global_batch_size
    shares = [list(itertools.islice(stream(data, replicas, r), n * G // replicas)) for r in range(replicas)]
    batches = []
    for k in range(n):
        blocks = [s for share in shares for s in share[k * G // replicas : (k + 1) * G // replicas]]
        batches.append(sorted((tuple(b["input_ids"].tolist()), b["stream"]) for b in blocks))
    return batches


@pytest.fixture
def small_windows(monkeypatch):
    monkeypatch.setattr(streaming, "WINDOW_TOKENS", 4 * 17 * 8)  # 4 global batches of 8 blocks per window


def test_global_batches_are_the_same_blocks_whatever_the_data_parallel_size(jsonl_corpus, small_windows):
    data = TextDataModule(str(jsonl_corpus), text_column="body", streaming=True, seq_len=16, global_batch_size=8)
    one, four = global_batches(data, 1, 30), global_batches(data, 4, 30)
    assert [[b for b, _ in batch] for batch in one] == [[b for b, _ in batch] for batch in four]
    text = data.tokenizer.decode([t for batch in one for b, _ in batch for t in b])
    assert "quick brown fox" in text and "document 1" in text and '"body"' not in text
    epochs = {json.loads(tag)["epoch"] for batch in one for _, tag in batch}
    assert epochs == {0, 1}  # the stream cycled into its second epoch within 30 batches


def test_resuming_at_a_recorded_position_continues_with_the_next_unseen_block(jsonl_corpus, small_windows):
    data = TextDataModule(str(jsonl_corpus), text_column="body", streaming=True, seq_len=16, global_batch_size=8)
    uninterrupted = [s["input_ids"].tolist() for s in itertools.islice(stream(data, 1, 0), 8 * 60)]
    tags = [json.loads(s["stream"]) for s in itertools.islice(stream(data, 1, 0), 8 * 60)]
    next_epoch = [t["epoch"] for t in tags].index(1) // 8
    for k in (3, 4, 9, next_epoch, next_epoch + 5):  # mid-window, window starts, the next epoch, inside it
        position = tags[8 * k - 1]  # what the last block of global batch k - 1 records
        resumed = [s["input_ids"].tolist() for s in itertools.islice(stream(data, 2, 1, position), 4 * 3)]
        expected = [b for j in range(3) for b in uninterrupted[8 * (k + j) : 8 * (k + j + 1)][1::2]]
        assert resumed == expected, k
    assert tags[8 * 4 - 1]["window"] == 1 and tags[8 * 4 - 2]["window"] == 0 and 20 < next_epoch < 30


def test_held_out_blocks_never_reach_training_and_bad_settings_are_refused(jsonl_corpus):
    data = TextDataModule(str(jsonl_corpus), text_column="body", streaming=True, seq_len=16, global_batch_size=8)
    data.data_parallel = (1, 0)
    data.setup("fit")
    held = Counter(tuple(b["input_ids"].tolist()) for b in [*data.val_set, *data.test_set])
    epoch = itertools.takewhile(lambda s: json.loads(s["stream"])["epoch"] == 0, iter(data._stream_loader().dataset))
    trained = Counter(tuple(s["input_ids"].tolist()) for s in epoch)
    reader = streaming.BlockReader(data._open_documents()(str(jsonl_corpus)), data.tokenizer, 17)
    every = Counter(tuple(b.tolist()) for b in streaming.draw_blocks([reader], [1.0], None, 10**6))
    assert held.total() == 2 * round(0.05 * every.total()) and trained + held <= every
    assert every.total() - held.total() - trained.total() < 8  # only the last, partial global batch is left
    with pytest.raises(ValueError, match="num_workers=2 must be 0 or 1"):
        TextDataModule(str(jsonl_corpus), text_column="body", streaming=True, num_workers=2)
    with pytest.raises(ValueError, match=r"part0.jsonl' has no column 'text' \(its columns: \['body', 'id'\]\)"):
        TextDataModule(str(jsonl_corpus / "part0.jsonl"), text_column="text", streaming=True)


def test_a_streaming_mixture_follows_its_weights(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 40_000)
    (tmp_path / "b.txt").write_text("b" * 40_000)
    data = TextDataModule({str(tmp_path / "a.txt"): 7, str(tmp_path / "b.txt"): 3}, streaming=True, seq_len=7,
                          global_batch_size=4)  # fmt: skip
    blocks = [s["input_ids"][0].item() for s in itertools.islice(stream(data, 1, 0), 4000)]
    assert np.mean(np.array(blocks) == ord("a")) == pytest.approx(0.7, abs=0.02)


def test_a_streaming_run_trains_and_records_its_position(jsonl_corpus, tmp_path):
    data = TextDataModule(str(jsonl_corpus), text_column="body", streaming=True, seq_len=31, global_batch_size=4)
    trainer, log_dir = fit(GPT("tiny"), data, tmp_path / "run", max_steps=3)
    assert len(logged(log_dir, "train_loss")) == 3
    assert data.state_dict()["stream"] == {**data.state_dict()["stream"], "epoch": 0, "window": 0, "batch": 3}


@pytest.fixture(scope="module")
def resumed_from_a_stream(base_job, corpus, tmp_path_factory) -> dict:
    """A streaming run at DP2, checkpointed after step `HALF` (mid-epoch), and resumed on one process."""
    from conftest import dp2_then_resumed_on_one_process
    from layouts import merge

    out = tmp_path_factory.mktemp("streaming_runs")
    return dp2_then_resumed_on_one_process(merge(base_job, {"data": {"streaming": True}}), out)


def test_a_streaming_run_resumes_mid_epoch_on_another_dp_size(resumed_from_a_stream):
    uninterrupted, resumed = resumed_from_a_stream["dp2"]["losses"], resumed_from_a_stream["resume_single"]["losses"]
    assert len(uninterrupted) == STEPS and len(resumed) == STEPS - HALF and uninterrupted[-1] < uninterrupted[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, uninterrupted[HALF:])) <= 1e-5


def test_a_restored_position_is_saved_again_until_training_moves_it(jsonl_corpus):
    position = {"epoch": 0, "window": 1, "batch": 2, "sources": [{"documents": None, "skip": 0}]}
    data = TextDataModule(str(jsonl_corpus), text_column="body", streaming=True)
    data.load_state_dict({"stream": position})
    assert data.state_dict() == {"stream": position}
    with pytest.raises(ValueError, match="recorded with streaming=True; resume it with the same data.streaming"):
        TextDataModule(str(jsonl_corpus), text_column="body").load_state_dict({"stream": position})
