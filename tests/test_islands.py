"""DiLoCo's islands: exact against synchronous DP where the maths says so, fewer bytes between islands (measured as
the planner counts them), a loss near synchronous DP's, and checkpoints that resume in the middle of an outer step."""

import pytest
import torch
import torch.distributed as dist
from layouts import merge
from lightning.pytorch.callbacks import Callback
from spawned import run_jobs

from lit3d.callbacks import CommReport
from lit3d.parallel.rank_map import rank_map

EXACT = {"outer_lr": 1.0, "outer_momentum": 0.0}  # one round = the islands' average
STEPS = 8  # steps of the runs whose curves are compared: two outer steps of DiLoCo's H
H = 4
AVERAGED = 3  # steps of the every-step-averaged runs (each step an outer step)
SAVED = 8  # steps of the run saved after step 6 (H=4) and of its resumed copy


class OuterSteps(Callback):
    """At every outer step: how far the synced weights are from the mean of the islands' inner results, and from
    the other islands' synced weights (max abs difference over this rank's tensors, over their max magnitude)."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def on_train_start(self, trainer, pl_module) -> None:
        loop = trainer.strategy.optimizer_steps.outer_loop
        sync, group = loop.sync, loop.group

        def gathered(tensors: list[torch.Tensor]) -> torch.Tensor:
            flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
            every = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
            dist.all_gather(every, flat, group=group)
            return torch.stack(every)

        def recorded_sync(fragment: int = 0, across=None) -> None:
            before = gathered([get() for get in loop.tensors])
            sync(fragment, across)
            after = gathered([get() for get in loop.tensors])
            scale = before.abs().max()
            self.records.append({
                "inner_step": int(loop.inner_steps),
                "from_mean": float((after[0] - before.double().mean(0)).abs().max() / scale),
                "between_islands": float((after - after[0]).abs().max() / scale),
                "moved": float((before[0] - before[1]).abs().max() / scale),
            })  # fmt: skip

        loop.sync = recorded_sync

    def results(self) -> dict:
        return {"outer_steps": self.records}


def islands(k: int, h: int, **more) -> dict:
    return {"strategy": {"zero_stage": 1, "islands": k, "sync_every": h} | more}


@pytest.fixture(scope="module")
def runs(base_job, tmp_path_factory) -> dict:
    """Jobs on 4 ranks in one spawn: synchronous DP4, one island of DP4, and 2 islands x DP2; `STEPS` steps where
    the curve is compared or must fall, fewer where each step is checked (`AVERAGED`)."""
    out = tmp_path_factory.mktemp("islands")
    base = merge(base_job, {"trainer": {"max_steps": STEPS, "val_check_interval": STEPS // 2}})
    averaged, saved = (merge(base, {"trainer": {"max_steps": steps}}) for steps in (AVERAGED, SAVED))
    bytes_over = lambda steps: {"callbacks": [CommReport(step=4, steps=steps, verbose=False)]}
    step6 = str(out / "save" / "ckpts" / "step=6.ckpt")
    jobs = {
        "sync_dp4": merge(base, {"strategy": {"zero_stage": 1}, **bytes_over(H)}),
        "one_island_h3": merge(base, islands(1, 3, **EXACT)),
        "average_h1": merge(averaged, {**islands(2, 1, **EXACT), "callbacks": [OuterSteps()]}),
        # the same check where each rank holds FSDP2 shards, a pipeline stage, tensor-parallel shards
        "average_h1_zero3": merge(averaged, {**islands(2, 1, **EXACT, zero_stage=3), "callbacks": [OuterSteps()]}),
        "average_h1_pp2": merge(
            averaged, {**islands(2, 1, **EXACT, pipeline_parallel_size=2), "callbacks": [OuterSteps()]}
        ),
        "average_h1_tp2": merge(
            averaged, {**islands(2, 1, **EXACT, tensor_parallel_size=2), "callbacks": [OuterSteps()]}
        ),
        # Muon as the inner optimizer (each island's matrices spread over its 2 replicas for the iteration)
        "average_h1_muon": merge(
            averaged,
            {**islands(2, 1, **EXACT), "callbacks": [OuterSteps()], "model": {"optimizer": "muon"}},
        ),
        "streaming_bf16": merge(
            base, {**islands(2, 4, outer_fragments=2, outer_reduce_dtype="bfloat16"), **bytes_over(4)}
        ),
        "diloco": merge(base, {**islands(2, H), **bytes_over(H)}),
        "save": merge(saved, {**islands(2, 4), "checkpoint_every": 6}),
        "resume": merge(saved, {**islands(2, 4), "ckpt_path": step6}),
    }
    return run_jobs(4, jobs, out)


def relative_difference(losses, reference):
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


def test_one_island_with_plain_outer_steps_is_synchronous_data_parallelism(runs):
    # anchor - 1 x (anchor - weights) is the weights: every outer step (each 3 steps) changes nothing but rounding
    sync, one = runs["sync_dp4"], runs["one_island_h3"]
    assert len(sync["losses"]) == STEPS and sync["losses"][-1] < sync["losses"][0] - 1.0
    print(f"\none island H=3 vs sync DP4: train {relative_difference(one['losses'], sync['losses']):.2e}, "
          f"val {relative_difference(one['val_loss'], sync['val_loss']):.2e}")  # fmt: skip
    assert relative_difference(one["losses"], sync["losses"]) <= 1e-5
    assert relative_difference(one["val_loss"], sync["val_loss"]) <= 1e-5


def test_synchronous_dp4_and_one_island_follow_the_single_process_curve(runs, base_job, tmp_path):
    from spawned import run_job

    # the same steps on one process (the learning-rate schedule follows max_steps)
    one = run_job(merge(base_job, {"trainer": {"max_steps": STEPS, "val_check_interval": STEPS // 2}}), tmp_path)
    for job in ("sync_dp4", "one_island_h3"):
        difference = max(abs(a - b) for a, b in zip(runs[job]["losses"], one["losses"], strict=True))
        print(f"\n{job} vs one process: max abs {difference:.2e}")
        assert difference <= 1e-5


@pytest.mark.parametrize(
    "job", ["average_h1", "average_h1_zero3", "average_h1_pp2", "average_h1_tp2", "average_h1_muon"]
)
def test_every_step_averaged_islands_hold_the_mean_of_their_inner_steps(runs, job):
    records = runs[job]["outer_steps"]
    assert [r["inner_step"] for r in records] == list(range(1, AVERAGED + 1))
    print(f"\nH=1: max from the mean {max(r['from_mean'] for r in records):.2e}, "
          f"between islands {max(r['between_islands'] for r in records):.2e}")  # fmt: skip
    for r in records:
        assert r["moved"] > 1e-4  # the islands did step apart (their halves of the batch differ) ...
        assert r["from_mean"] <= 1e-5 and r["between_islands"] == 0.0  # ... and meet at their mean
    sums = [rank["param_sum"] for rank in runs[job]["ranks"]]
    assert sums[0] == sums[2] and sums[1] == sums[3]  # the same weights in both islands at the end


def test_diloco_sends_sync_every_times_fewer_bytes_between_islands_as_the_planner_counts(runs):
    """Mean bytes per step over H steps (one outer step), busiest rank per axis, measured under CommDebugMode."""
    diloco, sync = runs["diloco"]["comm_bytes"], runs["sync_dp4"]["comm_bytes"]
    measured, planned = diloco["measured"], diloco["planned"]
    print(f"\nbytes per step: sync DP4 dp {sync['measured']['dp']:.0f}; DiLoCo H={H} dp {measured['dp']:.0f}, "
          f"island {measured['island']:.0f} (planned {planned['island']:.0f})")  # fmt: skip
    for axis in ("dp", "island"):  # scalars (the logged loss, the norm) are left out by the planner
        assert planned[axis] <= measured[axis] <= planned[axis] + 256 / H, (axis, measured, planned)
    # The outer step all-reduces each rank's ZeRO-1 slice (half the model) over 2 islands once per H steps; the
    # same slice every step would be synchronous DP at its best (hierarchical), so the bytes fall exactly H times.
    assert measured["island"] * H == pytest.approx(planned["island"] * H, abs=256)
    assert sync["measured"]["dp"] >= H * measured["island"]  # and a flat DP4 ring sends more still (3 H here)


def test_diloco_loss_stays_near_synchronous_data_parallelism(runs):
    sync, diloco = runs["sync_dp4"], runs["diloco"]
    gap = diloco["val_loss"][-1] / sync["val_loss"][-1] - 1  # after the last step: two outer steps, the islands agree
    print(f"\nval loss after {STEPS} steps: sync {sync['val_loss'][-1]:.4f}, DiLoCo H={H} {diloco['val_loss'][-1]:.4f} "
          f"({gap:+.2%})")  # fmt: skip
    assert diloco["losses"][-1] < diloco["losses"][0] - 1.0  # it learns
    # NOTE: the margin: at most 5 % above synchronous DP. Below it is allowed: on this small corpus the outer
    # Nesterov step (lr 0.7, momentum 0.9) amplifies the first rounds' progress (measured: 13 % lower after 8 steps
    # with H=4).
    assert -0.3 <= gap <= 0.05


def test_resuming_in_the_middle_of_an_outer_step_continues_the_curve_exactly(runs):
    # saved after inner step 6 of 8 with H=4: two steps into the second outer round, islands apart; the resumed run
    # ends that round with the outer step
    saved, resumed = runs["save"]["losses"], runs["resume"]["losses"]
    assert len(saved) == SAVED and resumed == saved[6:]
    assert [r["param_sum"] for r in runs["resume"]["ranks"]] == [r["param_sum"] for r in runs["save"]["ranks"]]


def test_the_checkpoint_holds_each_islands_weights_and_the_outer_state_by_name(runs):
    import torch.distributed.checkpoint as dcp

    folder = f"{runs['save']['job_dir']}/ckpts/step=6.ckpt"
    keys = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    name = "model.blocks.1.mlp.up_proj.weight"
    assert f"state_dict.{name}" in keys and f"island1.state_dict.{name}" in keys  # islands differ mid-round
    assert f"island1.optimizer_states.0.state.{name}.exp_avg" in keys
    assert keys[f"outer.anchor.{name}"].size == keys[f"state_dict.{name}"].size  # global shapes, not slices
    assert f"outer.momentum.{name}" in keys and "outer.inner_steps" in keys


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"islands": 0}, "islands=0 must be a positive integer"),
        ({"sync_every": 0}, "sync_every=0 must be a positive integer"),
        ({"outer_lr": 0.0}, "outer_lr=0.0 must be a number > 0"),
        ({"outer_momentum": 1.0}, r"outer_momentum=1.0 must be in \[0, 1\)"),
        ({"outer_fragments": 4, "sync_every": 2}, "outer_fragments=4 is more than sync_every=2"),
        ({"outer_reduce_dtype": "float16"}, "outer_reduce_dtype='float16' is not one of float32, bfloat16"),
        ({"islands": 3, "data_parallel_size": 4}, "islands=3 does not divide data_parallel_size=4"),
        ({"islands": 2, "data_parallel_size": 4, "expert_parallel_size": 2}, "islands=2 with expert_parallel_size=2"),
        ({"islands": 2, "data_parallel_size": 2, "context_parallel_size": 2}, "context_parallel_size=2 is not supp"),
    ],
)
def test_bad_island_settings_are_refused_with_the_values_named(kwargs, message):
    from lit3d.strategies import Parallel3DStrategy

    with pytest.raises(ValueError, match=message):
        Parallel3DStrategy(**kwargs)


def test_islands_are_the_outermost_digit_and_the_rank_map_shows_them():
    from lit3d.parallel.layout import resolve_layout

    layout = resolve_layout(8, 4, "auto", 2, 1, islands=2)  # 2 islands x (dp 2 x tp 2), 4 devices per node
    assert (layout.dp, layout.islands, layout.data_replicas) == (2, 2, 4)
    assert [layout.island(r) for r in range(8)] == [0] * 4 + [1] * 4  # an island is a node here
    assert [layout.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout.island_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    text = rank_map(layout)
    assert "8 ranks = 2 islands x (dp 2 x tp 2 x pp 1)" in text and "node  rank  island  (p, d, t)" in text
    assert "   1     5       1  (0, 0, 1)" in text


def test_the_planner_counts_the_outer_step_and_what_it_saves_against_synchronous_dp(capsys):
    from lit3d.cli import main

    main(["plan", "--model", "llama-70b", "--nodes", "16", "--islands", "2", "--inter_island_bandwidth", "1",
          "--sync_every", "100"])  # fmt: skip
    text = capsys.readouterr().out
    assert "DiLoCo: 2 islands, an outer step every 100 inner steps, over 1 GB/s per GPU" in text
    assert "DiLoCo saves 99.0% of the traffic between islands (100x fewer bytes)" in text
    assert "--trainer.strategy.islands=2 --trainer.strategy.sync_every=100" in text
    main(["plan", "--model", "llama-70b", "--nodes", "16", "--islands", "2", "--tensor_parallel_size", "8",
          "--pipeline_parallel_size", "1", "--sync_every", "100", "--outer_reduce_dtype", "bfloat16",
          "--json"])  # fmt: skip
    import json

    report = json.loads(capsys.readouterr().out)
    islands = report["islands"]
    assert report["layout"]["islands"] == 2 and report["layout"]["data_parallel_size"] == 8  # per island
    # each GPU all-reduces its ZeRO-1 slice (1/8 of its TP shard of 70.6B) with one other island, in bf16
    slice_bytes = report["params_per_rank"] / 8 * 2
    assert islands["outer_sync_bytes"] == pytest.approx(slice_bytes, rel=0.01)
    assert islands["synchronous_bytes"] == pytest.approx(100 * 2 * islands["outer_sync_bytes"], rel=1e-6)  # fp32


def test_the_planner_counts_the_anchor_and_its_momentum_and_the_run_holds_them(runs):
    """The outer loop holds an fp32 anchor of what the inner optimizer steps, and a Nesterov momentum as large: 8
    bytes per stepped element beside the inner optimizer's (4 without momentum). The plan check measures them with
    the rest (its peak counts what the outer loop holds from the start), and DiLoCo's run peaks at its plan."""
    from lit3d.planner import Cluster, Request, plan

    def optimizer_bytes(**settings) -> int:
        given = dict(tensor_parallel_size=8, pipeline_parallel_size=1, zero_stage=1, global_batch_size=64)
        report = plan(Request.given("llama-8b", Cluster(nodes=4), seq_len=2048, **given, **settings))
        return report.chosen.plan.memory_per_gpu["optimizer"]

    synchronous = optimizer_bytes()  # (one island with an outer step every 8 steps: the same slices)
    stepped = synchronous / 12  # ZeRO-1's fp32 master slices and AdamW's two moments (and a few step counts)
    with_momentum = optimizer_bytes(sync_every=8)
    plain = optimizer_bytes(sync_every=8, outer_momentum=0.0)
    assert with_momentum - synchronous == pytest.approx(8 * stepped, rel=1e-4)
    assert plain - synchronous == pytest.approx(4 * stepped, rel=1e-4)
    ratio = runs["diloco"]["plan_check"]["peak_memory_ratio"]
    assert len(ratio) == 1 and ratio[0] == pytest.approx(1.0, abs=0.02), ratio


def test_streaming_in_bf16_sends_half_the_bytes_in_fragments(runs):
    """Two fragments, each synced once per 4 steps at staggered steps (2 and 4), pseudo-gradients in bf16."""
    comm = runs["streaming_bf16"]["comm_bytes"]
    measured, planned = comm["measured"]["island"], comm["planned"]["island"]
    assert planned <= measured <= planned + 256 / 4
    fp32_per_step = runs["diloco"]["comm_bytes"]["measured"]["island"]  # (the whole slice once per H steps)
    assert measured == pytest.approx(fp32_per_step * H / 4 / 2, abs=64)  # half the slice per 4 steps, in bf16
    assert runs["streaming_bf16"]["losses"][-1] < runs["streaming_bf16"]["losses"][0] - 1.0
