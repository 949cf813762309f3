"""`lit3d.parallel.Parallelism`: the one description of a run that builds the strategy, documents its arguments and
feeds the planner."""

from __future__ import annotations

import inspect
from dataclasses import FrozenInstanceError, fields, replace

import pytest

from lit3d.parallel.arguments import argument_table
from lit3d.parallel.layout import Layout
from lit3d.parallel.settings import Parallelism, defaults
from lit3d.strategies import Parallel3DStrategy


def test_the_strategy_takes_exactly_the_settings_with_their_defaults():
    signature = inspect.signature(Parallel3DStrategy.__init__).parameters
    arguments = {name: p.default for name, p in signature.items() if name != "self"}
    assert arguments == defaults()
    assert list(arguments) == [f.name for f in fields(Parallelism)]  # the same order, so the help reads the same


def test_the_strategy_keeps_the_value_it_was_built_from():
    settings = Parallelism(
        tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=2, mixed_precision_reduce="bfloat16"
    )
    strategy = Parallel3DStrategy.of(settings)
    assert strategy.parallelism == settings
    assert Parallel3DStrategy(tensor_parallel_size=2).parallelism == Parallelism(tensor_parallel_size=2)


def test_the_value_is_frozen_and_checked_when_made_or_replaced():
    settings = Parallelism()
    with pytest.raises(FrozenInstanceError):
        settings.zero_stage = 3
    with pytest.raises(ValueError, match="zero_stage=5 must be 0, 1, 2 or 3"):
        replace(settings, zero_stage=5)
    with pytest.raises(ValueError, match="mixed_precision_reduce='fp8' is not one of 'float32', 'bfloat16'"):
        Parallelism(mixed_precision_reduce="fp8")
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be a positive integer"):
        Parallel3DStrategy(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="outer_fragments=3 is more than sync_every=2"):
        Parallelism(sync_every=2, outer_fragments=3)


def test_derived_settings():
    assert Parallelism(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b").chunks_per_rank == 2
    assert Parallelism(pipeline_parallel_size=2, pipeline_schedule="zbv").chunks_per_rank == 2
    assert not Parallelism(sequence_parallel=True).splits_sequence(Layout(dp=2, tp=1, pp=1, devices_per_node=2))
    assert Parallelism(sequence_parallel=True).splits_sequence(Layout(dp=1, tp=2, pp=1, devices_per_node=2))
    assert Parallelism(sync_every=4).runs_outer_loop and not Parallelism().runs_outer_loop
    assert Parallelism(sequence_parallel=True, tensor_parallel_size=1).warnings() == [
        "sequence_parallel=True does nothing with tensor_parallel_size=1"
    ]


def test_auto_tensor_parallelism_follows_lightning_for_a_module_that_parallelises_itself():
    settings = Parallelism()  # tensor_parallel_size="auto", as ModelParallelStrategy's default
    assert settings.sizes(devices_per_node=4, lit3d_splits=False)["tensor_parallel_size"] == 4
    assert settings.sizes(devices_per_node=4, lit3d_splits=True)["tensor_parallel_size"] == 1  # lit3d.GPT: when asked
    assert (
        Parallelism(tensor_parallel_size=2).sizes(devices_per_node=4, lit3d_splits=False)["tensor_parallel_size"] == 2
    )


def test_every_setting_is_documented_where_the_cli_reads_it():
    from docstring_parser import parse  # what jsonargparse reads for --trainer.strategy.help

    documented = {p.arg_name: p.description for p in parse(Parallel3DStrategy.__doc__).params}
    for f in fields(Parallelism):
        assert documented[f.name] == f.metadata["help"], f.name
    table = argument_table()
    assert all(f"| `{f.name}` |" in table for f in fields(Parallelism))
