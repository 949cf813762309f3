"""Where the text comes from: files chosen by what they are, saved datasets, HuggingFace datasets, mixtures.

A source is read into a `datasets.Dataset` with one column, ``text``, one row per document:

- text files (``.txt``, ``.md``, source code, ... see `TEXT_SUFFIXES`): one document per file;
- ``.json``/``.jsonl`` (also ``.gz``/``.zst`` compressed), ``.parquet``, ``.csv``, ``.arrow``: one document per
  row, its ``text_column``, read by `datasets`' own builder for the format;
- a folder written by ``Dataset.save_to_disk`` (its ``train`` split if it is a ``DatasetDict``);
- ``hf:NAME`` (a dataset on the HuggingFace hub, or a local dataset folder): ``load_dataset(NAME, name, split)``.

A folder or a glob may mix formats. A file of any other suffix is refused, naming it, and so is a missing
column, naming the columns the file has: nothing is read as text that is not text.
"""

from __future__ import annotations

import csv
import glob
import gzip
import itertools
import json
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TEXT_SUFFIXES = frozenset(
    ".txt .text .md .rst .tex .py .pyi .c .h .cc .cpp .hpp .cu .java .js .ts .go .rs .rb .sh .lua .jl .scala .kt "
    ".swift .php .pl .r .sql .html .css .xml .yaml .yml .toml .cfg .ini".split()
)
TABLE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
COMPRESSED = (".gz", ".zst")  # json and jsonl only: `datasets` reads them through its compression support
HUB_PREFIX = "hf:"


def file_format(path: str | Path) -> str:
    """``"text"`` or the `datasets` builder name for ``path``, chosen by its suffix; refuses anything else."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if len(suffixes) >= 2 and suffixes[-1] in COMPRESSED and suffixes[-2] in (".json", ".jsonl"):
        return "json"
    suffix = suffixes[-1] if suffixes else ""
    if suffix in TEXT_SUFFIXES:
        return "text"
    if suffix in TABLE_BUILDERS:
        return TABLE_BUILDERS[suffix]
    raise ValueError(
        f"{str(path)!r}: unknown format {suffix or '(no suffix)'!r}; lit3d reads text files "
        f"({', '.join(sorted(TEXT_SUFFIXES)[:6])}, ...), .json/.jsonl (.gz, .zst), .parquet, .csv and .arrow"
    )


def resolve_files(data_path: str) -> list[str]:
    """A file, a folder (every file below it, hidden ones left out) or a glob → a sorted list of files."""
    if any(ch in data_path for ch in "*?["):
        files = sorted(f for f in glob.glob(data_path, recursive=True) if Path(f).is_file())
        if not files:
            raise FileNotFoundError(f"data_path={data_path!r}: the glob matches no file")
    elif Path(data_path).is_dir():
        files = sorted(
            str(f)
            for f in Path(data_path).rglob("*")
            if f.is_file() and not any(part.startswith(".") for part in f.relative_to(data_path).parts)
        )
        if not files:
            raise FileNotFoundError(f"data_path={data_path!r}: the folder holds no file")
    elif Path(data_path).is_file():
        files = [data_path]
    else:
        raise FileNotFoundError(f"data_path={data_path!r} does not exist")
    if all(Path(f).stat().st_size == 0 for f in files):
        raise ValueError(f"data_path={data_path!r} holds only empty files")
    return files


def is_saved_dataset(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and any((path / name).is_file() for name in ("state.json", "dataset_dict.json"))


def check_source(data_path: str, text_column: str | None = None, split: str = "train") -> None:
    """Refuse, before anything is read, a source that does not exist or holds a file of an unknown format, and given
    ``text_column``, a table or saved dataset without that column (only headers and schemas are read)."""
    from lit3d.data.prepared import is_prepared

    if data_path.startswith(HUB_PREFIX) or is_prepared(data_path):
        return
    if is_saved_dataset(data_path):
        if text_column is not None:
            check_column(saved_columns(data_path, split), text_column, data_path)
        return
    files = resolve_files(data_path)
    tables = [file for file in files if file_format(file) != "text"]  # every file's format first, then the columns
    for file in tables if text_column is not None else []:
        check_column(table_columns(file), text_column, file)


def check_column(columns: list[str] | None, column: str, source: str) -> None:
    """Refuse a source whose ``columns`` lack the text ``column`` (None: columns unknown until the rows are read)."""
    if columns is not None and column not in columns:
        raise ValueError(f"{source!r} has no column {column!r} (its columns: {columns}); set text_column")


def table_columns(file: str) -> list[str] | None:
    """The columns of a table file from its header or schema, as `datasets` will read them; None where that takes
    reading the whole file (a JSON array)."""
    builder = file_format(file)
    if builder == "parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(file).names
    if builder == "arrow":  # `datasets` writes the streaming format; the file format has a footer instead
        import pyarrow as pa

        with pa.memory_map(file) as source:
            try:
                return pa.ipc.open_stream(source).schema.names
            except pa.ArrowInvalid:
                return pa.ipc.open_file(source).schema.names
    if builder == "csv":
        with open(file, newline="", encoding="utf-8") as f:
            return next(csv.reader(f), [])
    return _json_lines_columns(file)


def _json_lines_columns(file: str, head_bytes: int = 2**20) -> list[str] | None:
    """The keys of the records on the first lines (up to ``head_bytes``), in order of first appearance, as pyarrow
    infers a JSON Lines schema; None if a line is not one record (a JSON array, or an object over many lines)."""
    columns: dict[str, None] = {}
    with _open_text(file) as lines:
        for number, line in enumerate(itertools.islice(lines, 1000), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))
            except ValueError as error:
                if columns:  # JSON Lines so far: this line is malformed
                    raise _malformed(file, number, error) from None
                return None
            if not isinstance(record, dict):
                return None
            columns.update(dict.fromkeys(record))
            head_bytes -= len(line)
            if head_bytes <= 0:
                break
    return list(columns) if columns else None


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """`datasets`' bars ("Downloading data", "Generating train split") off while local files are read: nothing is
    downloaded, and the tokenizing that follows shows its own progress."""
    import datasets

    was_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def _open_text(file: str) -> Any:
    """``file`` opened as text, decompressed as `datasets` reads it (``.gz``, ``.zst``)."""
    suffix = Path(file).suffix.lower()
    if suffix == ".zst":
        import zstandard

        return zstandard.open(file, "rt", encoding="utf-8")
    return gzip.open(file, "rt", encoding="utf-8") if suffix == ".gz" else open(file, encoding="utf-8")


def _malformed(file: str, line: int, error: ValueError) -> ValueError:
    column = f", column {error.colno}" if isinstance(error, json.JSONDecodeError) else ""
    message = error.msg if isinstance(error, json.JSONDecodeError) else str(error)
    return ValueError(f"{file}, line {line}{column}: not valid JSON ({message}); each line must be one JSON record")


def malformed_json_line(file: str) -> ValueError | None:
    """The error naming the first line of a JSON Lines ``file`` that is not JSON, or None (every line is, or the file
    is one JSON document over many lines). Read only once `datasets` has failed on the file."""
    records = 0
    with _open_text(file) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                json.loads(line.rstrip("\r\n"))
            except ValueError as error:
                return _malformed(file, number, error) if records else None
            records += 1
    return None


def saved_columns(path: str, split: str) -> list[str] | None:
    """The columns of a `save_to_disk` folder (its ``split`` if a ``DatasetDict``), from its ``dataset_info.json``."""
    folder = Path(path) / split if (Path(path) / "dataset_dict.json").is_file() else Path(path)
    info = folder / "dataset_info.json"
    features = json.loads(info.read_text()).get("features") if info.is_file() else None
    return list(features) if isinstance(features, dict) else None


def load_documents(
    data_path: str,
    text_column: str = "text",
    name: str | None = None,
    split: str = "train",
    cache_dir: str | None = None,
    streaming: bool = False,
) -> Any:
    """The documents of one source as a `datasets.Dataset` with the single column ``text`` (with ``streaming``, a
    `datasets.IterableDataset` that reads the files as it goes and caches nothing)."""
    import datasets

    if data_path.startswith(HUB_PREFIX):
        loaded = datasets.load_dataset(
            data_path[len(HUB_PREFIX) :], name=name, split=split, cache_dir=cache_dir, streaming=streaming
        )
        return _text_column(loaded, text_column, data_path)
    if is_saved_dataset(data_path):
        loaded = datasets.load_from_disk(data_path)
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded[split]
        return _text_column(loaded.to_iterable_dataset() if streaming else loaded, text_column, data_path)
    by_format: dict[str, list[str]] = defaultdict(list)
    for file in resolve_files(data_path):
        by_format[file_format(file)].append(file)
    parts = []
    for builder, files in sorted(by_format.items()):
        if builder == "text":  # one row per file, so packing sees whole files in order
            options = dict(sample_by="document", split="train", cache_dir=cache_dir, streaming=streaming)
            with _no_progress_bars():
                parts.append(datasets.load_dataset("text", data_files=files, **options))
            continue
        for file in files:  # one at a time, so a missing column or a malformed line names its file
            try:
                with _no_progress_bars():
                    loaded = datasets.load_dataset(
                        builder, data_files=[file], split="train", cache_dir=cache_dir, streaming=streaming
                    )
            except Exception as error:
                malformed = malformed_json_line(file) if builder == "json" else None
                if malformed is None:
                    raise
                raise malformed from error
            parts.append(_text_column(loaded, text_column, file))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _text_column(dataset: Any, column: str, source: str) -> Any:
    columns = dataset.column_names
    if columns is None:  # a stream whose columns show only in its rows
        columns = list(next(iter(dataset), {}))
    check_column(columns, column, source)
    dataset = dataset.select_columns([column])
    return dataset.rename_column(column, "text") if column != "text" else dataset
