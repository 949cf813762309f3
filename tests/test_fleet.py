"""The fleet planner (`lit3d.planner.fleet`): node groups of different GPU kinds in one job. Uneven stages and shares
by speed, each stage priced on its own GPU, the plan against its two baselines, its flags accepted by ``lit3d fit``,
and bad fleets refused in one line. (docs/mixed-fleets.md runs the llama-70b example through tests/test_docs.py.)"""

import functools
import itertools
import random
from dataclasses import replace

import pytest

from lit3d.cli import main
from lit3d.models.config import GPTConfig
from lit3d.parallel.layout import Layout
from lit3d.parallel.stages import partition
from lit3d.planner import Cluster, Training, estimate
from lit3d.planner.fleet import parse_fleet, pipeline_cluster, shared_cluster, speed, water_fill
from lit3d.planner.fleet_report import format_fleet, plan_fleet
from lit3d.planner.hardware import GPUS

LLAMA_8B = GPTConfig.load("llama-8b")


@pytest.fixture(scope="module")
def small_fleet():
    """llama-8b on one H100 node and one A100 node, at 8,192 tokens a sequence (at 4,096 data-parallel shares win),
    planned once for the module: a few seconds."""
    return plan_fleet(parse_fleet("1x8xH100,1x8xA100"), "llama-8b", global_batch_size=256, seq_len=8192)


@pytest.mark.parametrize(
    "fleet, named",
    [
        ("2x8", "'2x8' is not NODESxGPUSxKIND"),
        ("2x8xH100,6x8xZ100", "unknown GPU 'Z100'"),
        ("0x8xH100,1x8xA100", "'0x8xH100' needs at least one node"),
        ("2x8xH100", "two node groups or more, got 1"),
        ("1x8xH100,1x4xA100", "[4, 8] GPUs per node"),
    ],
)
def test_a_bad_fleet_is_refused_in_one_line_naming_it(fleet, named):
    with pytest.raises(SystemExit) as error:
        main(["plan", "--model", "tiny", "--fleet", fleet])
    message = str(error.value.code)
    assert message.startswith("lit3d plan: error: ") and named in message and "\n" not in message, message


def test_fleet_refuses_what_it_replaces_and_what_it_chooses():
    with pytest.raises(SystemExit) as error:
        main(["plan", "--model", "tiny", "--fleet", "1x8xH100,1x8xA100", "--nodes", "2"])
    assert "--nodes: not with --fleet" in str(error.value.code)
    with pytest.raises(ValueError, match="pipeline_parallel_size: a fleet plan chooses"):
        plan_fleet(parse_fleet("1x8xH100,1x8xA100"), "tiny", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the 8 GPUs of a node"):
        plan_fleet(parse_fleet("1x8xH100,1x8xA100"), "tiny", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_schedule='zbv': uneven stages are planned with one chunk"):
        plan_fleet(parse_fleet("1x8xH100,1x8xA100"), "tiny", pipeline_schedule="zbv")


def test_partition_with_speeds_gives_a_faster_chunk_more_blocks_and_equal_speeds_change_nothing():
    costs = [1.0] * 12
    assert partition(costs, 0, 0, 2, [2.0, 1.0]) == [list(range(8)), list(range(8, 12))]
    assert partition(costs, 0.5, 0.5, 3, [1.0, 1.0, 1.0]) == partition(costs, 0.5, 0.5, 3)


def test_partition_reaches_the_least_largest_chunk_of_every_cut():
    """`partition` against every way of cutting (small random cases, ties common): consecutive non-empty chunks of
    all the blocks, whose largest cost is the least of any cut."""
    chooser = random.Random(0)
    for _ in range(300):
        n = chooser.randint(1, 9)
        chunks = chooser.randint(1, n)
        costs = [float(chooser.choice([1, 2, 3])) for _ in range(n)]
        first, last = chooser.choice([0.0, 1.0, 4.0]), chooser.choice([0.0, 2.0])
        speeds = [chooser.choice([1.0, 2.0]) for _ in range(chunks)]
        largest = functools.partial(_largest_chunk, costs, first, last, speeds)
        cuts = list(itertools.combinations(range(1, n), chunks - 1))
        runs = partition(costs, first, last, chunks, speeds)
        assert [b for run in runs for b in run] == list(range(n)) and all(runs), runs
        assert largest(tuple(run[0] for run in runs[1:])) == min(map(largest, cuts)), (costs, first, last, speeds)


def _largest_chunk(costs: list[float], first: float, last: float, speeds: list[float], starts: tuple) -> float:
    runs = [sum(costs[i:j]) for i, j in itertools.pairwise([0, *starts, len(costs)])]
    runs[0], runs[-1] = runs[0] + first, runs[-1] + last
    return max(run / speed for run, speed in zip(runs, speeds))


def test_water_fill_deals_micro_batches_by_speed_at_least_one_each():
    assert water_fill(12, [2.0, 1.0]) == [8, 4]
    assert water_fill(4, [100.0, 1.0, 1.0]) == [2, 1, 1]
    assert sum(water_fill(10, [3.0, 1.0, 1.0])) == 10


def test_each_pipeline_stage_is_priced_on_its_own_gpu_and_held_to_its_own_memory():
    """H100 and A100 stages of an even split: the step lies between all-H100 and all-A100; a stage moved onto a 40 GB
    A100 stops fitting what fits on an 80 GB one."""
    h100, a100 = Cluster.of(GPUS["H100"], 1), Cluster.of(GPUS["A100"], 1)
    layout, training = Layout(dp=1, tp=8, pp=2, devices_per_node=8), Training(seq_len=4096, global_batch_size=64)
    fleet = pipeline_cluster(shared_cluster([h100, a100]), [h100, a100], 8)
    clusters = {"H100": replace(h100, nodes=2), "A100": replace(a100, nodes=2), "both": fleet}
    steps = {name: estimate(LLAMA_8B, cluster, layout, training).step_time_s for name, cluster in clusters.items()}
    assert steps["H100"] < steps["both"] <= steps["A100"], steps
    plan = estimate(LLAMA_8B, fleet, layout, replace(training, micro_batch_size=16, global_batch_size=256))
    small = replace(fleet, stage_gpus=(GPUS["H100"], GPUS["A100 40GB"]))
    tight = estimate(LLAMA_8B, small, layout, replace(training, micro_batch_size=16, global_batch_size=256))
    assert plan.fits and 36e9 < tight.memory_by_stage[1]["total"] < 72e9 and not tight.fits


def test_the_chosen_plan_beats_both_baselines_and_reports_each_group(small_fleet):
    report = small_fleet
    chosen = report.chosen
    assert chosen.kind == "pipeline"
    fastest, slowest = report.baselines
    assert chosen.step_time_s < fastest.step_time_s and chosen.step_time_s < slowest.step_time_s
    layers = chosen.candidate.parallelism.pipeline_stage_layers
    assert sum(layers) == report.config.n_layer and layers[0] > layers[-1]  # the H100 stage holds more blocks
    data = report.to_dict()
    groups = data["chosen"]["groups"]
    assert [g["gpu"] for g in groups] == ["H100", "A100"]
    assert [n for g in groups for n in g["pipeline_stage_layers"]] == list(layers)
    assert {o["kind"] for o in data["baselines"]} == {"fastest group", "slowest kind"}
    text = format_fleet(report)
    assert "chosen: uneven pipeline stages" in text and "the chosen plan is" in text and "node ranks" in text


def test_the_data_option_deals_the_global_batch_in_whole_micro_batches_more_to_faster_gpus(small_fleet):
    data = next(o for o in small_fleet.options if o.kind == "data")
    shares = data.candidate.parallelism.data_parallel_shares
    accumulate = data.candidate.training.accumulate_grad_batches
    assert sum(shares) == 256 and all(s % accumulate == 0 for s in shares)
    h100, a100 = data.parts
    assert min(h100["data_parallel_shares"]) >= max(a100["data_parallel_shares"])
    assert speed(GPUS["H100"]) > speed(GPUS["A100"])


def test_equal_groups_get_an_island_each_and_unequal_ones_are_told_why(small_fleet):
    islands = next(o for o in small_fleet.options if o.kind == "islands")
    assert islands.candidate.layout.islands == 2 and len(islands.parts) == 2
    report = plan_fleet(parse_fleet("1x8xH100,2x8xA100"), "125m", global_batch_size=64, seq_len=1024)
    unequal = next(o for o in report.options if o.kind == "islands")
    assert unequal.candidate is None and "[8, 16] GPUs" in unequal.note


def test_lit3d_fit_accepts_the_printed_flags_as_they_are(small_fleet, capsys):
    flags = small_fleet.flags().split()
    assert "--trainer.strategy.pipeline_stage_layers=[" in small_fleet.flags()
    with pytest.raises(SystemExit) as done:
        main(["fit", *flags, "--print_config"])
    assert done.value.code in (0, None)
    printed = capsys.readouterr().out
    layers = small_fleet.chosen.candidate.parallelism.pipeline_stage_layers
    assert "pipeline_stage_layers:" in printed and all(f"- {n}" in printed for n in set(layers))


def test_the_rank_map_colours_ranks_by_gpu_kind(small_fleet):
    picture = small_fleet.rank_map()
    assert picture._colour(0, 0) != picture._colour(1, 0) and picture._colour(1, 0) == picture._colour(1, 1)
    heading = picture._heading(*picture._drawn())
    assert "colour = GPU kind (H100 blue, A100 orange)" in heading
