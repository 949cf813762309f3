"""Data for real runs: every format read by what it is, a column named, unknown formats refused, HuggingFace
dataset folders, and mixtures by weight."""

import gzip
import json

import datasets
import pytest

from lit3d.data import TextDataModule
from lit3d.data.sources import file_format
from lit3d.data.tokenizers import tokenize_documents

DOCUMENTS = [f"document {i}: the quick brown fox jumps over the lazy dog " * 3 for i in range(40)]


def write(path, fmt: str, column: str = "content") -> None:
    """``DOCUMENTS`` as one file of ``fmt`` with the text in ``column`` (and a second column beside it)."""
    rows = [{"id": i, column: text} for i, text in enumerate(DOCUMENTS)]
    table = datasets.Dataset.from_list(rows)
    lines = "".join(json.dumps(row) + "\n" for row in rows)
    if fmt == "jsonl":
        path.write_text(lines)
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "jsonl.gz":
        path.write_bytes(gzip.compress(lines.encode()))
    elif fmt == "jsonl.zst":
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    elif fmt == "parquet":
        table.to_parquet(str(path))
    elif fmt == "csv":
        table.to_csv(str(path), index=False)
    elif fmt == "arrow":
        import pyarrow as pa

        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.data.table.schema) as writer:
            writer.write_table(table.data.table)
    elif fmt == "txt":
        path.write_text("\n".join(DOCUMENTS))


def decoded_blocks(data: TextDataModule) -> str:
    data.setup("fit")
    blocks = [*data.train_set[:]["input_ids"], *data.val_set[:]["input_ids"], *data.test_set[:]["input_ids"]]
    return "".join(data.tokenizer.decode(b.tolist()) for b in blocks)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "jsonl.gz", "jsonl.zst", "parquet", "csv", "arrow", "txt"])
def test_each_format_is_read_as_what_it_is(fmt, tmp_path):
    path = tmp_path / f"corpus.{fmt}"
    write(path, fmt)
    text = decoded_blocks(TextDataModule(str(path), text_column="content", seq_len=31, global_batch_size=2))
    assert "the quick brown fox" in text and "document 7:" in text
    assert '{"' not in text and '"content"' not in text and "\\n" not in text  # no syntax of the file's format


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet", "csv", "arrow"])
def test_a_missing_column_is_refused_naming_the_file_and_its_columns_before_anything_is_read(fmt, tmp_path):
    write(tmp_path / f"corpus.{fmt}", fmt)
    with pytest.raises(ValueError, match=r"corpus.\S+' has no column 'text' \(its columns: \['id', 'content'\]\)"):
        TextDataModule(str(tmp_path / f"corpus.{fmt}"), text_column="text", seq_len=31, global_batch_size=2)


def test_a_file_of_unknown_format_is_refused_before_anything_is_read(tmp_path):
    write(tmp_path / "corpus.jsonl", "jsonl")
    (tmp_path / "weights.bin").write_bytes(b"\x00\x01binary")
    with pytest.raises(ValueError, match=r"weights.bin': unknown format '.bin'"):
        TextDataModule(str(tmp_path))
    assert file_format("a.JSONL.ZST") == "json" and file_format("b.py") == "text"


def test_a_huggingface_dataset_folder_with_its_split(tmp_path):
    folder = tmp_path / "hub_dataset" / "data"
    folder.mkdir(parents=True)
    write(folder / "train.jsonl", "jsonl")
    write(folder / "test.jsonl", "jsonl")
    data = TextDataModule(f"hf:{folder.parent}", split="test", text_column="content", seq_len=31, global_batch_size=2)
    assert "the quick brown fox" in decoded_blocks(data)


def test_a_mixture_draws_blocks_by_its_weights(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 40_000)
    (tmp_path / "b.txt").write_text("b" * 40_000)  # 5,000 blocks of 8 bytes each
    data = TextDataModule({str(tmp_path / "a.txt"): 7, str(tmp_path / "b.txt"): 3}, seq_len=7, global_batch_size=4)
    mixture = data._packed_blocks()
    blocks = [mixture[i]["input_ids"] for i in range(len(mixture))]
    share = sum(block[0] == ord("a") for block in blocks) / len(blocks)
    assert len(blocks) > 5000 and share == pytest.approx(0.7, abs=0.02)
    with pytest.raises(ValueError, match="positive, finite weight"):
        TextDataModule({str(tmp_path / "a.txt"): 0})


@pytest.mark.parametrize("defined_by", ["post_processor", "tokenizer_config"])
def test_documents_get_the_bos_and_eos_their_tokenizer_defines(defined_by, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "the": 3, "fox": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if defined_by == "post_processor":
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    else:
        config = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "add_bos_token": True}
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text("the fox the fox")
    data = TextDataModule(str(tmp_path / "corpus.txt"), tokenizer=str(tmp_path))
    assert (data.tokenizer.bos_id, data.tokenizer.eos_id) == (1, 2)
    assert tokenize_documents({"text": ["the fox"]}, data.tokenizer)["input_ids"][0].tolist() == [1, 3, 4, 2]


def test_a_mixture_from_the_command_line(tmp_path, monkeypatch):
    from lit3d.cli import make_cli

    monkeypatch.chdir(tmp_path)  # LightningCLI saves its config.yaml here
    (tmp_path / "a.txt").write_text("a" * 400)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "b" * 400}) + "\n")
    mixture = json.dumps({str(tmp_path / "a.txt"): 7, str(tmp_path / "b.jsonl"): 3})
    cli = make_cli([f"--data.init_args.data_path={mixture}", "--trainer.logger=false"], run=False)
    assert cli.datamodule.sources == {str(tmp_path / "a.txt"): 0.7, str(tmp_path / "b.jsonl"): 0.3}
    plain = make_cli([f"--data.init_args.data_path={tmp_path / 'a.txt'}", "--trainer.logger=false"], run=False)
    assert plain.datamodule.sources == {str(tmp_path / "a.txt"): 1.0}
