"""Uneven pipeline stages (``pipeline_stage_layers``): the blocks each stage runs as given, losses equal to one
process in every schedule and with ZeRO, the planner's tensors and memory per stage the run's, and bad lists refused
by name before any process starts."""

import pytest
import torch
from layouts import HALF, STEPS
from uneven_layouts import SHARE_LAYOUTS, UNEVEN_GPT, UNEVEN_LAYOUTS

from lit3d import GPTConfig
from lit3d.parallel.settings import Parallelism
from lit3d.parallel.stages import check_stage_layers, stage_runs


@pytest.mark.parametrize("layout", UNEVEN_LAYOUTS)
def test_uneven_stages_train_like_one_process(layout, layout_runs, reference_uneven_run):
    run, reference = layout_runs[layout], reference_uneven_run
    assert len(run["losses"]) == len(reference["losses"]) == STEPS and reference["losses"][-1] < reference["losses"][0]
    for key in ("losses", "val_loss"):
        assert len(run[key]) == len(reference[key]) > 0, key
        assert max(abs(a - b) for a, b in zip(run[key], reference[key])) <= 1e-5, (key, run[key], reference[key])


@pytest.mark.parametrize(
    "layers, schedule, held",
    [([1, 5], "1f1b", [["0"], ["1", "2", "3", "4", "5"]]),
     ([2, 1, 2, 1], "interleaved_1f1b", [["0", "1", "3", "4"], ["2", "5"]]),  # stage s on rank s % 2
     ([2, 1, 2, 1], "zbv", [["0", "1", "5"], ["2", "3", "4"]])],  # a V: rank 0 holds stages 0 and 3
)  # fmt: skip
def test_each_rank_keeps_the_blocks_its_stages_are_given(layers, schedule, held):
    from lit3d.models.transformer import Transformer
    from lit3d.parallel.schedules import SCHEDULES
    from lit3d.strategies.pipelining.chunks import split_into_stages

    for rank in range(2):
        with torch.device("meta"):
            network = Transformer(GPTConfig(**UNEVEN_GPT))
        placement = SCHEDULES[schedule].placement
        split_into_stages(network, rank, 2, 2 if len(layers) == 4 else 1, placement, tuple(layers))
        assert list(network.blocks) == held[rank]


def test_the_planner_holds_each_stage_as_given_and_the_parallelised_model_agrees():
    from lit3d.planner import Cluster, Request, plan
    from lit3d.strategies.split.count import held_params

    cluster = Cluster(nodes=1, gpus_per_node=2)
    counts = {}
    for layers in ([1, 5], [5, 1]):
        request = Request.given(GPTConfig(**UNEVEN_GPT), cluster, tensor_parallel_size=1, pipeline_parallel_size=2,
                                pipeline_stage_layers=layers, seq_len=32, global_batch_size=8,
                                verify=held_params)  # fmt: skip
        report = plan(request)
        assert report.verified and all(count.matches for count in report.verified), report.verified
        counts[tuple(layers)] = [count.analytic for count in report.verified]
    assert counts[(1, 5)][0] < counts[(1, 5)][1] and counts[(5, 1)][0] > counts[(5, 1)][1]


def test_the_command_line_plan_takes_the_stage_layers(capsys):
    """tiny's 4 blocks as 1+3 load the last stage most, as 3+1 the first."""
    from lit3d.cli import main

    for layers, loaded in (("[1, 3]", 1), ("[3, 1]", 0)):
        main(["plan", "--model", "tiny", "--gpus_per_node", "2", "--tensor_parallel_size", "1",
              "--pipeline_parallel_size", "2", "--pipeline_stage_layers", layers])  # fmt: skip
        assert f"most loaded rank (pipeline stage {loaded})" in capsys.readouterr().out


@pytest.mark.parametrize(
    "layers, n_layer, message",
    [((1, 4), 6, r"pipeline_stage_layers=\[1, 4\] sums to 5 blocks, but the model has n_layer=6"),
     ((0, 0), 0, r"pipeline_stage_layers=\[0, 0\] must give each of the 2 pipeline stages"),
     ((6,), 6, r"pipeline_stage_layers=\[6\] must give each of the 2 pipeline stages")],
)  # fmt: skip
def test_bad_stage_layers_are_refused_naming_them(layers, n_layer, message):
    with pytest.raises(ValueError, match=message):
        check_stage_layers(layers, n_layer, 2)
    if n_layer == sum(layers) and len(layers) != 2 or not any(layers):
        with pytest.raises(ValueError, match=message):
            Parallelism(pipeline_parallel_size=2, pipeline_stage_layers=list(layers))
    assert stage_runs([1.0] * 6, 0.0, 0.0, 2, (2, 4)) == [[0, 1], [2, 3, 4, 5]]


@pytest.mark.parametrize("layout", [name for name in SHARE_LAYOUTS if "resumed" not in name])
def test_uneven_data_parallel_shares_train_like_one_process(layout, layout_runs, reference_run):
    """Each replica computes its share of every global batch of 8 (its micro-batches that size), its loss weighted
    by it: the step is the single-process step, at ZeRO-1 and ZeRO-3, with TP too."""
    run, reference = layout_runs[layout], reference_run
    shares = SHARE_LAYOUTS[layout][1]["strategy"]["data_parallel_shares"]
    replica_of = [rank["sampler"]["rank"] for rank in run["ranks"]]
    assert [rank["sampler"]["batch_size"] for rank in run["ranks"]] == [shares[r] for r in replica_of]
    for key in ("losses", "val_loss"):
        assert len(run[key]) == len(reference[key]) > 0, key
        assert max(abs(a - b) for a, b in zip(run[key], reference[key])) <= 1e-5, (key, run[key], reference[key])


def test_a_run_with_uneven_shares_resumes_with_even_ones_on_the_same_curve(layout_runs, reference_run):
    resumed = layout_runs["dp2_even_resumed_from_shares"]["losses"]
    assert len(resumed) == STEPS - HALF
    assert max(abs(a - b) for a, b in zip(resumed, reference_run["losses"][HALF:])) <= 1e-5


@pytest.mark.parametrize(
    "shares, batch, steps, message",
    [((6, 1), 8, 1, r"data_parallel_shares=\[6, 1\] sums to 7 samples, not the global_batch_size=8"),
     ((5, 3), 8, 2, r"data_parallel_shares=\[5, 3\]: \[5, 3\] not whole numbers of the 2 micro-batches"),
     ((4, 2, 2), 8, 1, r"data_parallel_shares=\[4, 2, 2\] has 3 shares for data_parallel_size=2 replicas")],
)  # fmt: skip
def test_bad_shares_are_refused_naming_them(shares, batch, steps, message):
    from lit3d.parallel.shares import check_shares_fit

    with pytest.raises(ValueError, match=message):
        check_shares_fit(shares, 2, batch, steps)
    with pytest.raises(ValueError, match=r"data_parallel_shares=\[0, 8\] must be whole numbers of samples"):
        Parallelism(data_parallel_shares=[0, 8])


def test_the_first_and_the_last_stage_may_hold_the_embedding_or_the_head_in_place_of_a_block():
    """Llama 3 405B's cut: 126 blocks on 16 x 8 = 128 stages, the first and the last stage one block less; one or two
    stages more than blocks are cut so by default; a stage between them without a block is refused."""
    from lit3d.parallel.stages import end_layers

    check_stage_layers((0, 6), 6, 2)
    check_stage_layers((6, 0), 6, 2)
    with pytest.raises(ValueError, match=r"\[3, 0, 3\] must give each of the 3 pipeline stages .* \(0 for the first"):
        check_stage_layers((3, 0, 3), 6, 3)
    assert end_layers(126, 128) == (0, *[1] * 126, 0) and end_layers(4, 5) == (1, 1, 1, 1, 0)
    assert end_layers(6, 6) is None and end_layers(6, 9) is None
    assert stage_runs([1.0] * 4, 2.0, 3.0, 6) == [[], [0], [1], [2], [3], []]


def test_llama3_405b_plans_and_is_parallelised_at_pp16_with_8_virtual_stages():
    """The real model split on the fake process group (``--verify``) holds what the planner counts on every stage;
    the first holds the embedding alone, the last the head alone."""
    from lit3d.planner import Cluster, Request, plan
    from lit3d.strategies.split.count import held_params

    request = Request.given("llama-405b", Cluster(nodes=16), tensor_parallel_size=8, pipeline_parallel_size=16,
                            virtual_pipeline_size=8, pipeline_schedule="interleaved_1f1b", seq_len=8192,
                            global_batch_size=16, verify=held_params)  # fmt: skip
    report = plan(request)
    assert report.verified and all(count.matches for count in report.verified), report.verified
    assert report.chosen.layout.pp == 16 and report.chosen.parallelism.chunks_per_rank == 8
