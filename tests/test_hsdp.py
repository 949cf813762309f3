"""HSDP (``data_parallel_shard_size``): ZeRO inside shard groups of consecutive data-parallel ranks, the groups
replicas of one another (`hsdp_layouts.py` for the runs)."""

import pytest
from hsdp_layouts import HSDP_LAYOUTS
from layouts import HALF, STEPS

from lit3d.models.config import GPTConfig
from lit3d.parallel.layout import Layout
from lit3d.parallel.rank_map import rank_map
from lit3d.parallel.settings import Parallelism
from lit3d.planner import Cluster, Request, plan
from lit3d.planner.estimate import link_speeds
from lit3d.planner.hardware import GPUS

TRAINED = [name for name in HSDP_LAYOUTS if "resumed" not in name]


@pytest.mark.parametrize("layout", TRAINED)
def test_shard_groups_train_like_one_process(layout, layout_runs, reference_run):
    run = layout_runs[layout]
    # (accumulating, its validation runs on micro-batches: half as many samples)
    for key in ("losses",) if "accumulate" in layout else ("losses", "val_loss"):
        assert len(run[key]) == len(reference_run[key]) > 0, key
        assert max(abs(a - b) for a, b in zip(run[key], reference_run[key])) <= 1e-5, (key, run[key])


@pytest.mark.parametrize("layout", TRAINED)
def test_bytes_within_and_across_the_groups_are_the_planners(layout, layout_runs):
    """ZeRO's traffic stays in each group (``dp_shard``); the groups all-reduce their shards (``dp_replicate``)."""
    measured, planned = (layout_runs[layout]["comm_bytes"][kind] for kind in ("measured", "planned"))
    assert "dp" not in measured and "dp" not in planned
    for axis in ("dp_shard", "dp_replicate"):
        assert planned[axis] > 0, (axis, planned)
        assert planned[axis] <= measured[axis] <= planned[axis] + 256, (axis, measured, planned)
    assert measured["other"] <= 64


def test_the_groups_all_reduce_once_per_step_whatever_the_micro_steps(layout_runs):
    # ZeRO-2 accumulating 2 micro-steps reduce-scatters twice in each group, and all-reduces across them once.
    once = layout_runs["dp4_shard2_zero3"]["comm_bytes"]["measured"]["dp_replicate"]
    assert layout_runs["dp4_shard2_zero2_accumulate2"]["comm_bytes"]["measured"]["dp_replicate"] == once


def test_a_checkpoint_written_in_shard_groups_resumes_in_another_layout(layout_runs, reference_run):
    resumed = layout_runs["dp2_tp2_zero1_resumed_from_dp4_shard2_zero3"]["losses"]
    assert len(resumed) == STEPS - HALF
    assert max(abs(a - b) for a, b in zip(resumed, reference_run["losses"][HALF:])) <= 1e-5


@pytest.mark.parametrize(
    "settings, message",
    [(dict(data_parallel_size=4, data_parallel_shard_size=3), r"data_parallel_shard_size=3 does not divide data_pa"),
     (dict(data_parallel_shard_size=2, zero_stage=0), r"data_parallel_shard_size=2 with zero_stage=0: nothing is"),
     (dict(data_parallel_shard_size=1), r"data_parallel_shard_size=1 shards nothing"),
     (dict(data_parallel_shard_size=0), r"data_parallel_shard_size=0 must be a positive integer")],
)  # fmt: skip
def test_shard_groups_that_cannot_run_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        Parallelism(**settings)


def test_shard_groups_of_every_replica_are_plain_zero_and_others_must_split_the_launched_replicas():
    assert Parallelism(data_parallel_shard_size=4, zero_stage=3).resolve(4, 4).dp_shard is None
    with pytest.raises(ValueError, match="data_parallel_shard_size=4 does not divide data_parallel_size=6"):
        Parallelism(data_parallel_shard_size=4, zero_stage=3).resolve(6, 6)


def test_the_rank_map_shows_each_ranks_group_and_shard():
    layout = Parallelism(data_parallel_shard_size=2, tensor_parallel_size=2, zero_stage=3).resolve(8, 8)
    assert (layout.shard_size, layout.dp_replicate, layout.shard_ranks) == (2, 2, 2)
    text = rank_map(layout)
    assert "HSDP: ZeRO shards over groups of 2 consecutive data-parallel ranks (stride 2); the 2 groups" in text
    rows = [line.split() for line in text.splitlines()[-8:]]
    assert [row[-3:] for row in rows[::2]] == [["0,", "shard", "1/2"], ["0,", "shard", "2/2"],
                                               ["1,", "shard", "1/2"], ["1,", "shard", "2/2"]]  # fmt: skip


def test_the_planner_prices_the_groups_on_their_links_and_holds_shards_of_a_group():
    cluster = Cluster.of(GPUS["H100"], 16, 8)
    links = link_speeds(cluster, Layout(dp=128, tp=1, pp=1, devices_per_node=8, dp_shard=8))
    assert links["dp_shard"] == 450 and links["dp_replicate"] == 50  # a node's NVLink; one member per node: a NIC
    config, plans = GPTConfig.load("llama-8b"), {}
    for shard in (None, 8):
        sizes = dict(data_parallel_size=128, tensor_parallel_size=1, pipeline_parallel_size=1, zero_stage=3)
        request = Request.given(config, cluster, **sizes, data_parallel_shard_size=shard, global_batch_size=128)
        plans[shard] = plan(request).chosen.plan
    whole, grouped = plans[None], plans[8]
    assert whole.memory_per_gpu["optimizer"] * 128 == pytest.approx(grouped.memory_per_gpu["optimizer"] * 8, rel=1e-3)
    assert (
        set(grouped.communication_per_step) >= {"dp_shard", "dp_replicate"}
        and "dp" not in grouped.communication_per_step
    )
    across = grouped.communication_per_step["dp_replicate"]["bytes"]  # fp32 gradients of a 1/8 shard, once
    assert across == pytest.approx(2 * 15 / 16 * config.num_params / 8 * 4, rel=0.01)


def test_plan_says_whether_hsdp_wins_and_why_and_runs_it(capsys):
    """At 512 nodes groups of 64 save the ring's latency over 4,096 replicas (llama-70b on 16 nodes, where they do not
    pay, is docs/data-parallel-and-zero.md's, which tests/test_docs.py runs)."""
    from lit3d.cli import main

    main(["plan", "--model", "llama-8b", "--nodes", "512", "--global_batch_size", "4096"])
    out = capsys.readouterr().out
    assert "HSDP wins here: ZeRO-3 in 64 shard groups of 64" in out, out
    assert "why: a group spans 8 nodes" in out and "all-reduce across groups" in out
    assert "--trainer.strategy.zero_stage=3 --trainer.strategy.data_parallel_shard_size=64" in out


def test_the_page_shows_each_ranks_shard_group_where_the_groups_split_the_replicas():
    from lit3d.planner.explore import page_data
    from lit3d.planner.page import SCRIPT

    data = page_data("llama-8b", Cluster.of(GPUS["H100"], 2, 8), data_parallel_shard_size=4)
    grouped, ddp = data["layouts"]["16,1,1,1,1,3"], data["layouts"]["16,1,1,1,1,0"]
    assert grouped["shard"] == 4 and {"dp_shard", "dp_replicate"} <= set(grouped["comm"])
    assert "shard" not in ddp and "dp" in ddp["comm"]  # ZeRO-0 shards nothing: one all-reduce over every replica
    assert "Math.floor(a.d / shard) === Math.floor(b.d / shard)" in SCRIPT and "HSDP shard group" in SCRIPT


def test_plan_refuses_groups_that_split_no_layouts_replicas(capsys):
    from lit3d.cli import main

    with pytest.raises(SystemExit) as error:
        main(["plan", "--model", "llama-8b", "--nodes", "2", "--data_parallel_shard_size", "3"])
    assert "data_parallel_shard_size=3 does not divide the 16 GPUs" in str(error.value.code)
