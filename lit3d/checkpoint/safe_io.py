"""Reading checkpoint files without running code that is in them, and checking a folder is whole before reading it
(`check_readable`: every file its index names there and long enough, every tensor tiled by its chunks).

A checkpoint may come from elsewhere (a colleague, a download). Three of its parts are pickles, and plain
unpickling runs whatever a crafted file asks for:

- ``meta.pt`` (what Lightning saves besides tensors) is read with ``torch.load(weights_only=True)``, which rebuilds
  only tensors and plain containers, plus the allow-list below: numpy's array and dtype (the numpy RNG state) and
  Lightning's ``AttributeDict``.
- DCP's ``.metadata`` (where each shard lies) is read by `SafeFileSystemReader`, whose unpickler rebuilds only
  DCP's own metadata classes, torch sizes, dtypes and layouts, and paths.
- DCP's non-tensor entries (e.g. optimizer hyper-parameters) are read by `SafeLoadPlanner` with
  ``weights_only=True``; DCP's own planner reads them with ``weights_only=False``.

Anything else is refused with `UnsafeCheckpointError`, naming the file and what it tried to load; a file that is
empty, truncated or damaged (its pickle does not parse to its end) with `CorruptCheckpointError`, which says so
rather than advise loading it unchecked. Every lit3d path that opens a checkpoint reads through these
(``tests/test_safe_loading.py`` checks that none bypasses them).
"""

from __future__ import annotations

import io
import math
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lit3d.errors import CorruptCheckpointError, UnsafeCheckpointError

META_FILE = "meta.pt"  # a checkpoint folder's plain data: hyper-parameters, loops, RNG, layout


def _data_globals() -> list[Any]:
    import numpy as np
    from lightning.fabric.utilities.data import AttributeDict

    reconstruct = getattr(getattr(np, "_core", None), "multiarray", None) or np.core.multiarray
    numpy = [reconstruct._reconstruct, np.ndarray, np.dtype, *(type(np.dtype(t)) for t in ("uint32", "float64"))]
    return [*numpy, AttributeDict]  # Lightning's hyper-parameters container (a dict)


def load_meta(path: str | Path) -> Any:
    """``torch.load`` of a file lit3d wrote (``meta.pt``, or a ``lit3d convert`` file): data only. A checkpoint folder
    reads its ``meta.pt``, once `check_readable` finds the folder whole.

    A file that holds code is refused with `UnsafeCheckpointError`; one that is empty, truncated or damaged with
    `CorruptCheckpointError` (loading it without the safety checks would not help).
    """
    path = Path(path)
    if path.is_dir():
        check_readable(path)
        path = path / META_FILE
    try:
        with torch.serialization.safe_globals(_data_globals()):
            # NOTE: memory-mapped where the format allows (torch's zip files): every rank that reads a whole
            # single-file checkpoint shares the page cache instead of holding a copy
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as error:
        # NOTE: the weights-only unpickler refuses broken bytes and code alike; only a pickle that parses whole can
        # hold code worth refusing.
        if not _parses_whole(path):
            raise corrupt(path, error) from None
        reason = first_line(str(error).split("WeightsUnpickler error: ")[-1]).split(". ")[0]
        raise UnsafeCheckpointError(
            f"{str(path)!r} holds more than data ({reason}); lit3d refuses to run code from a checkpoint. If you "
            "trust the file, load it yourself with torch.load(..., weights_only=False) and save it again"
        ) from None
    except (EOFError, RuntimeError, KeyError, ValueError) as error:  # torch's readers on broken bytes
        raise corrupt(path, error) from None


def check_readable(path: Path) -> None:
    """A clear error for a missing, incomplete or foreign checkpoint (before any collective)."""
    if not path.exists():
        previous = path.with_name(path.name + ".old")
        hint = f" ({str(previous)!r} is the checkpoint an interrupted save replaced)" if previous.exists() else ""
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist{hint}")
    if path.is_dir() and not any(path.iterdir()):
        raise ValueError(f"checkpoint folder {str(path)!r} is empty")
    missing = [name for name in (".metadata", META_FILE) if not (path / name).is_file()]
    if missing:
        raise ValueError(
            f"{str(path)!r} is not a complete lit3d checkpoint: {', '.join(missing)} missing "
            "(an interrupted save leaves a '.partial' folder; use the previous checkpoint)"
        )
    metadata = SafeFileSystemReader(str(path)).read_metadata()
    check_sizes_are_stored(path, metadata)
    # Every shard file the metadata points into must be there, and long enough.
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise ValueError(f"checkpoint {str(path)!r} is incomplete: shard file {name!r} is missing")
        if file.stat().st_size < size:
            raise ValueError(
                f"checkpoint {str(path)!r} is truncated: {name!r} has {file.stat().st_size} bytes, "
                f"its index expects {size}"
            )


def check_sizes_are_stored(path: Path, metadata: Any) -> None:
    """Refuse metadata whose tensors are not tiled by their chunks, or whose chunks claim more bytes than their
    shards store: reading it would allocate what the file does not hold (a corrupt or crafted index)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        itemsize = torch.empty((), dtype=entry.properties.dtype).element_size()
        covered = 0
        for chunk in entry.chunks:
            numel = math.prod(chunk.sizes)
            stored = metadata.storage_data.get(MetadataIndex(fqn, chunk.offsets))
            if stored is None or numel * itemsize > stored.length:
                raise ValueError(
                    f"checkpoint {str(path)!r} is corrupt: {fqn!r} claims a {tuple(chunk.sizes)} chunk "
                    f"({numel * itemsize:,} bytes) but its shard stores {stored.length if stored else 0:,}"
                )
            covered += numel
        if covered != math.prod(entry.size):
            raise ValueError(
                f"checkpoint {str(path)!r} is corrupt: {fqn!r} claims size {tuple(entry.size)} "
                f"({math.prod(entry.size):,} elements) but its chunks hold {covered:,}"
            )


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:160]


def corrupt(path: str | Path, error: BaseException) -> CorruptCheckpointError:
    """The error for a checkpoint file no loader can read, naming it and what its reader met."""
    if Path(path).is_file() and Path(path).stat().st_size == 0:
        return CorruptCheckpointError(f"{str(path)!r} is empty (0 bytes): an interrupted save or copy")
    reason = first_line(str(error)).split(". ")[0] or type(error).__name__
    return CorruptCheckpointError(
        f"{str(path)!r} is corrupt or truncated ({reason}); use an earlier checkpoint or copy this one again"
    )


def _parses_whole(path: Path) -> bool:
    """Whether the file's pickle (``data.pkl`` of torch's zip format, else the file) parses from start to STOP."""
    import pickletools

    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                data = archive.read(next(n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"))
        else:
            data = path.read_bytes()
        for _ in pickletools.genops(data):
            pass
        return True
    except Exception:  # NOTE: any failure to parse means broken bytes, whatever the parser raised
        return False


# DCP's `.metadata`: module -> names its unpickler may rebuild (torch dtypes are checked by type below).
METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.path!r} tried to load {module}.{name}, which is not part of a checkpoint's metadata; "
            "lit3d refuses to run code from a checkpoint"
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader, but ``.metadata`` is unpickled by an unpickler that rebuilds only metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as file:
            try:
                metadata = _MetadataUnpickler(file, str(path)).load()
            except UnsafeCheckpointError:
                raise
            except Exception as error:  # NOTE: it rebuilds only metadata classes: anything else is broken bytes
                raise corrupt(path, error) from None
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{str(path)!r} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeBytes:
    """A load planner whose non-tensor entries load with ``weights_only=True``.

    NOTE: DCP's `DefaultLoadPlanner.load_bytes` is the same but for ``weights_only=False``, so it is restated here.
    """

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointError(
                f"checkpoint entry {read_item.dest_index.fqn!r} holds more than data: {str(error)[-200:]}"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """`DefaultLoadPlanner` that loads non-tensor entries as data only."""


class SafeEmptyLoadPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """`_EmptyStateDictLoadPlanner` (builds the state dict from the metadata) that loads non-tensor entries safely."""
