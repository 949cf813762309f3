import itertools

import datasets
import numpy as np
import pytest
import torch

from lit3d.data.sampler import GlobalBatchSampler
from lit3d.data.sources import resolve_files
from lit3d.data.text import TextDataModule, default_corpus, default_corpus_files


def documents(folder):
    return [p.read_text() for p in sorted(folder.rglob("*.txt"), key=str)]


def test_packing_cuts_the_token_stream_into_seq_len_plus_one_blocks(text_folder):
    data = TextDataModule(str(text_folder), seq_len=31, global_batch_size=2, val_fraction=0.1)
    blocks = np.array(data._packed_blocks()["input_ids"])
    stream = np.frombuffer("".join(documents(text_folder)).encode(), dtype=np.uint8)
    assert blocks.shape == (len(stream) // 32, 32)
    assert np.array_equal(blocks.reshape(-1), stream[: blocks.size])


def test_split_is_deterministic_and_disjoint(text_folder):
    def split():
        data = TextDataModule(str(text_folder), seq_len=31, global_batch_size=2, val_fraction=0.1, seed=3)
        data.setup("fit")
        return data

    a, b = split(), split()
    train, val, test = (
        {tuple(x.tolist()) for x in part[:]["input_ids"]} for part in (a.train_set, a.val_set, a.test_set)
    )
    total = len(train) + len(val) + len(test)
    assert len(val) == round(0.1 * total) and len(test) == round(0.05 * total)
    assert not train & val and not train & test and not val & test
    assert torch.equal(a.val_set[:]["input_ids"], b.val_set[:]["input_ids"])
    assert torch.equal(a.test_set[:]["input_ids"], b.test_set[:]["input_ids"])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_global_batch_k_holds_the_same_samples_for_1_2_and_4_replicas(accumulate):
    dataset, global_batch = list(range(103)), 8

    def global_batches(replicas):
        per_replica = []
        for rank in range(replicas):
            sampler = GlobalBatchSampler(dataset, global_batch, replicas, rank, shuffle=True, seed=5)
            sampler.set_epoch(1)
            micro = (
                list(itertools.batched(sampler, global_batch // (replicas * accumulate)))
                if hasattr(itertools, "batched")
                else _chunks(list(sampler), global_batch // (replicas * accumulate))
            )
            per_replica.append(micro)
        steps = len(per_replica[0]) // accumulate
        return [
            sorted(i for rank in per_replica for m in rank[k * accumulate : (k + 1) * accumulate] for i in m)
            for k in range(steps)
        ]

    one = global_batches(1)
    assert len(one) == 103 // 8 and all(len(batch) == 8 for batch in one)
    assert global_batches(2) == one
    assert global_batches(4) == one
    assert sorted(i for batch in one for i in batch) != list(range(96))  # shuffled, not the first 96


def _chunks(items, size):
    return [tuple(items[i : i + size]) for i in range(0, len(items), size)]


def test_resuming_mid_epoch_skips_what_was_consumed_whatever_the_replica_count():
    data = list(range(40))
    single = GlobalBatchSampler(data, 8, 1, 0, seed=1)
    single.set_epoch(3)
    four = [GlobalBatchSampler(data, 8, 4, r, seed=1) for r in range(4)]
    for sampler in four:
        sampler.resume_at(epoch=3, consumed_samples=16)  # 2 global batches consumed (by a run on any replica count)
    assert sorted(i for sampler in four for i in sampler) == sorted(single.epoch_order()[16:].tolist())
    assert len(four[0]) == 10  # the whole epoch: Lightning counts the batches it already ran
    assert len(list(four[0])) == 10  # and the next iteration starts from the beginning again


def test_dataloader_batches_per_replica(text_folder):
    data = TextDataModule(str(text_folder), seq_len=15, global_batch_size=8, val_fraction=0.2)
    data.data_parallel = (2, 1)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == (4, 16) and batch["input_ids"].dtype == torch.int64
    assert len(data.train_dataloader()) == (len(data.train_set) // 8 * 8) // 2 // 4


def test_inputs_a_file_a_glob_and_a_saved_dataset(text_folder, tmp_path):
    one_file = str(next(text_folder.glob("*.txt")))
    assert resolve_files(one_file) == [one_file]
    assert len(resolve_files(str(text_folder / "**" / "*.txt"))) == 6
    assert len(resolve_files(str(text_folder))) == 6
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": documents(text_folder)}).save_to_disk(str(saved))
    data = TextDataModule(str(saved), seq_len=31, global_batch_size=2, val_fraction=0.1)
    data.setup("fit")
    assert data.train_set[:]["input_ids"].shape[1] == 32


def test_local_tokenizer_json(text_folder, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train(
        [str(p) for p in text_folder.rglob("*.txt")],
        trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "</s>"]),
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    data = TextDataModule(str(text_folder), tokenizer=str(tmp_path / "tokenizer.json"), seq_len=7, global_batch_size=2)
    assert data.vocab_size <= 120 and data.tokenizer.eos_id == tokenizer.token_to_id("</s>")
    data.setup("fit")
    assert int(data.train_set[:]["input_ids"].max()) < data.vocab_size


def test_the_default_corpus_is_the_standard_library():
    files = default_corpus_files()
    assert len(files) > 50 and any(f.endswith("/os.py") for f in files)
    assert resolve_files(TextDataModule().data_path or default_corpus()) == files


def test_bad_inputs_are_refused_naming_the_value(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        TextDataModule(str(tmp_path / "nowhere"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        TextDataModule(str(tmp_path / "empty.txt"))
    with pytest.raises(FileNotFoundError, match="matches no file"):
        TextDataModule(str(tmp_path / "*.md"))
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt5'"):
        TextDataModule(tokenizer="gpt5")
    with pytest.raises(ValueError, match="global_batch_size=6 is not divisible by the data-parallel size 4"):
        GlobalBatchSampler(list(range(10)), 6, 4, 0)


def test_too_small_a_corpus_says_so(tmp_path):
    (tmp_path / "a.txt").write_text("tiny")
    data = TextDataModule(str(tmp_path / "a.txt"), seq_len=2, global_batch_size=4)
    with pytest.raises(ValueError, match="too few for a global batch of 4"):
        data.setup("fit")


def test_a_corpus_shorter_than_val_check_interval_validates_each_epoch_with_a_warning(text_folder, tmp_path):
    from helpers import fit, logged

    from lit3d import GPT

    data = TextDataModule(str(text_folder), seq_len=255, global_batch_size=4, val_fraction=0.2)  # ~10 batches/epoch
    with pytest.warns(UserWarning, match=r"val_check_interval=1000 is more than the \d+ batches an epoch"):
        trainer, log_dir = fit(GPT("tiny"), data, tmp_path, max_steps=15, val_check_interval=1000, limit_val_batches=1)
    assert logged(log_dir, "val_loss")  # validated at the end of each epoch instead of failing
