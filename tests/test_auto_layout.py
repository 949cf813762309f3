"""``--trainer.strategy=3d_auto`` (`lit3d.strategies.auto_layout`): the planner's fastest plan that fits this cluster,
model and data, chosen before any process starts; what was given is kept; nothing that fits is refused with the
nearest miss; a module that is not a lit3d GPT is refused by name. (The command line's run, trained like one process,
is in tests/test_cli.py.)"""

from types import SimpleNamespace

import pytest
import torch

from lit3d.models.config import GPTConfig
from lit3d.parallel.settings import Parallelism
from lit3d.planner import Request, plan
from lit3d.strategies.auto_layout import auto_cluster, choose

TINY = SimpleNamespace(config=GPTConfig.from_name("tiny"), lora=None)
TRAINER = SimpleNamespace(accumulate_grad_batches=1, precision="32-true")
DATA = SimpleNamespace(global_batch_size=4, seq_len=32)  # tests/test_cli.py's QUICK
SPLIT_ONLY_GB = 0.006  # per rank: the tiny model fits 4 CPU ranks only split (tests/test_cli.py runs it)


def chosen(memory_gb: float | None, **given) -> tuple[Parallelism, int, list[str]]:
    cluster = auto_cluster(torch.device("cpu"), 1, 4, None, memory_gb)
    return choose(Parallelism(auto_layout=True, **given), TINY, TRAINER, DATA, cluster)


def test_a_memory_limit_that_rules_out_data_parallelism_gets_a_split_layout_logged_with_its_flags():
    settings, accumulate, lines = chosen(SPLIT_ONLY_GB)
    assert settings.tensor_parallel_size * settings.pipeline_parallel_size > 1 and settings.auto_layout
    assert accumulate == 1 and lines[0].startswith("3d_auto chose: dp ") and "why: " in lines[1]
    if settings.pipeline_parallel_size > 1:  # the micro-batches planned are the ones run
        assert f"{settings.num_microbatches} micro-batch(es)" in lines[0]
    assert f"--trainer.strategy.tensor_parallel_size={settings.tensor_parallel_size}" in lines[2]
    cluster = auto_cluster(torch.device("cpu"), 1, 4, None, SPLIT_ONLY_GB)
    for zero_stage in range(4):  # plain data parallelism at this memory: not even one sequence per micro-batch fits
        plain = Request.given(TINY.config, cluster, tensor_parallel_size=1, pipeline_parallel_size=1,
                              zero_stage=zero_stage, seq_len=32, global_batch_size=4, micro_batch_size=1,
                              precision="32-true")  # fmt: skip
        assert not plan(plain).chosen.plan.fits


def test_given_sizes_are_kept():
    settings, _, lines = chosen(None, tensor_parallel_size=2)
    assert settings.tensor_parallel_size == 2 and "tp 2" in lines[0]


def test_nothing_that_fits_is_refused_before_any_rank_starts_with_the_nearest_miss():
    with pytest.raises(ValueError, match=r"no layout of tiny fits 4 ranks of 0.001 GB .* the nearest needs .* GB"):
        chosen(0.001)


def test_a_module_that_is_not_a_lit3d_gpt_is_refused_by_name():
    class Regression:
        config = {"hidden": 8}

    with pytest.raises(ValueError, match="auto_layout=True plans a lit3d GPT; Regression is not one"):
        choose(
            Parallelism(auto_layout=True),
            Regression(),
            TRAINER,
            DATA,
            auto_cluster(torch.device("cpu"), 1, 4, None, None),
        )
