"""The rank grid and the checks made before any process group exists."""

import pytest

from lit3d import GPTConfig
from lit3d.parallel.layout import Layout, check_model_fits_layout, resolve_layout
from lit3d.parallel.rank_map import rank_map
from lit3d.strategies import Parallel3DStrategy


def test_tp_is_innermost_and_pp_outermost():
    layout = Layout(dp=2, tp=2, pp=2, devices_per_node=4)
    assert [tuple(layout.coordinate(r)) for r in range(8)] == [  # (p, d, c, t)
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (0, 1, 0, 0),
        (0, 1, 0, 1),
        (1, 0, 0, 0),
        (1, 0, 0, 1),
        (1, 1, 0, 0),
        (1, 1, 0, 1),
    ]
    assert all(layout.rank(*layout.coordinate(r)) == r for r in range(8))  # global = t + d*T + p*T*D
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [layout.node(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # pipeline stages on different nodes
    assert layout.tp_groups_across_nodes() == []


def test_rank_map_shows_nodes_coordinates_and_group_sizes():
    text = rank_map(Layout(dp=2, tp=2, pp=2, devices_per_node=4))
    assert "8 ranks = dp 2 x tp 2 x pp 2, 2 node(s) x 4 device(s)" in text
    assert "   1     5  (1, 0, 1)" in text  # node 1, rank 5, (p, d, t)
    assert "WARNING" not in text


def test_a_tp_group_across_nodes_is_flagged_with_its_ranks():
    layout = Layout(dp=1, tp=4, pp=1, devices_per_node=2)
    assert layout.tp_groups_across_nodes() == [[0, 1, 2, 3]]
    text = rank_map(layout)
    assert "span nodes, e.g. ranks [0, 1, 2, 3]" in text and text.count("<- TP group spans nodes") == 4


def test_auto_data_parallel_fills_the_world():
    assert resolve_layout(8, 8, "auto", 2, 2) == Layout(dp=2, tp=2, pp=2, devices_per_node=8)


@pytest.mark.parametrize(
    "sizes, message",
    [
        ((8, 8, 3, 2, 1), r"data_parallel_size=3 x tensor_parallel_size=2 x pipeline_parallel_size=1 = 6, but 8 ranks"),
        (
            (8, 8, "auto", 3, 1),
            r"tensor_parallel_size=3 x pipeline_parallel_size=1 does not divide the 8 launched ranks",
        ),
    ],
)
def test_sizes_that_do_not_multiply_to_the_world_are_refused(sizes, message):
    with pytest.raises(ValueError, match=message):
        resolve_layout(*sizes)


@pytest.mark.parametrize(
    "field, config",
    [
        ("n_head=6", GPTConfig(n_head=6, n_kv_head=6, d_model=96, d_ff=256)),
        ("n_kv_head=2", GPTConfig(n_head=4, n_kv_head=2, d_ff=256)),
        ("d_ff=250", GPTConfig(n_head=4, d_ff=250)),
        ("padded_vocab_size=257", GPTConfig(n_head=4, d_ff=256, vocab_size=257, pad_vocab_multiple=1)),
    ],
)
def test_a_model_that_cannot_be_split_is_refused(field, config):
    with pytest.raises(ValueError, match=f"tensor_parallel_size=4 does not divide {field}"):
        check_model_fits_layout(config, Layout(dp=1, tp=4, pp=1, devices_per_node=4))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(zero_stage=4), "zero_stage=4 must be 0, 1, 2 or 3"),
        (dict(pipeline_schedule="pipedream"), "pipeline_schedule='pipedream' is not one of gpipe, 1f1b"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size=0 must be a positive integer"),
        (dict(data_parallel_size="many"), "data_parallel_size='many' must be a positive integer"),
    ],
)
def test_bad_strategy_arguments_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Parallel3DStrategy(**kwargs)


def test_sequence_parallel_without_tensor_parallel_warns():
    with pytest.warns(UserWarning, match="sequence_parallel=True does nothing with tensor_parallel_size=1"):
        Parallel3DStrategy(sequence_parallel=True, tensor_parallel_size=1)


def test_registered_as_3d():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["3d"]["strategy"] is Parallel3DStrategy


def test_an_unknown_reduce_dtype_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="mixed_precision_reduce='fp8' is not one of 'float32', 'bfloat16'"):
        Parallel3DStrategy(mixed_precision_reduce="fp8")


def test_the_rank_map_says_nothing_of_tensor_parallel_auto_for_a_module_lit3d_splits():
    """'auto' is 1 for a module lit3d splits (tensor parallelism only when asked): no line for it on every
    data-parallel run; a module that parallelises itself is told Lightning's convention."""
    from lit3d.parallel.rank_map import layout_lines
    from lit3d.parallel.settings import Parallelism

    parallelism = Parallelism(tensor_parallel_size="auto")
    layout = parallelism.resolve(world_size=2, devices_per_node=2)
    assert not any("tensor_parallel_size='auto'" in line for line in layout_lines(layout, parallelism, 1, True))
    told = [line for line in layout_lines(layout, parallelism, 1, False) if "tensor_parallel_size='auto'" in line]
    assert len(told) == 1 and "ModelParallelStrategy" in told[0]
