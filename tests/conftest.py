import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

from lit3d import GPTConfig  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; its CPU counterpart runs instead")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def small_config() -> GPTConfig:
    """Small enough for fast CPU tests, with grouped-query heads."""
    return GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=256, max_seq_len=64)


@pytest.fixture
def text_folder(tmp_path: Path) -> Path:
    """A folder of a few small text documents."""
    import random

    words = random.Random(0).choices(["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"], k=6 * 400)
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    for i in range(6):
        target = folder / ("sub" if i % 2 else "") / f"doc{i}.txt"
        target.write_text(" ".join(words[i * 400:(i + 1) * 400]) + "\n")
    return folder
