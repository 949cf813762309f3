"""Pipeline parallelism: the stage split, the schedules' constraints, and what a step reports."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import forked
import pytest
import torch
from layouts import STEPS

from lit3d import GPTConfig
from lit3d.models.transformer import Transformer
from lit3d.parallel.layout import check_model_fits_pipeline, default_microbatches
from lit3d.parallel.schedules import SCHEDULES, Costs, bubble_theory, describe_schedule, idle_time, peak_in_flight
from lit3d.parallel.stages import chunk_stage_ids, partition, stage_rank
from lit3d.strategies import Parallel3DStrategy
from lit3d.strategies.pipelining.chunks import block_costs, split_into_stages


def test_partition_balances_cost_with_embedding_and_head_counted():
    # 8 equal blocks, embedding and head each worth 2 blocks, 4 stages: 12 units, 3 per stage at best.
    runs = partition([1.0] * 8, first_extra=2.0, last_extra=2.0, chunks=4)
    assert runs == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert sum(runs, []) == list(range(8))  # consecutive, every block exactly once


def test_partition_minimises_the_largest_stage():
    costs = [5.0, 1.0, 1.0, 1.0, 1.0, 5.0]
    runs = partition(costs, first_extra=0.0, last_extra=0.0, chunks=3)
    assert max(sum(costs[i] for i in r) for r in runs) == 5.0  # [5] [1 1 1 1] [5]
    with pytest.raises(ValueError, match="cannot cut 6 blocks into 7 pipeline chunks"):
        partition(costs, 0.0, 0.0, 7)


def test_a_preset_splits_into_non_empty_stages():
    with torch.device("meta"):
        network = Transformer(GPTConfig.from_name("llama-8b"))
    runs = partition(*block_costs(network), 16)
    assert len(runs) == 16 and sum(len(r) for r in runs) == 32 and all(runs)
    assert len(runs[0]) < len(runs[8]) and len(runs[-1]) < len(runs[8])  # embedding and head lighten the ends


class ScaledTransformer(Transformer):
    """A network with an attribute and a part of its own that `Transformer` does not have."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.logit_scale = 0.5
        self.out_gain = torch.nn.Linear(1, 1, bias=False)  # registered after the head: runs with the last stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return x * self.logit_scale * self.out_gain.weight[0, 0] if self.out_gain is not None else x


@pytest.mark.parametrize("pp, virtual, placement", [(2, 1, "loop"), (2, 2, "loop"), (4, 1, "loop"), (2, 2, "v")])
def test_stages_run_in_order_compute_the_whole_network(small_config, pp, virtual, placement):
    """The split is generic: each rank's chunks share every attribute of the network, so the chunks of all
    ranks run one after the other give the unsplit network's output."""
    torch.manual_seed(0)

    def build() -> ScaledTransformer:
        network = ScaledTransformer(small_config.__class__(**{**small_config.to_dict(), "n_layer": 4}))
        network.reset_parameters(seed=0)
        return network

    whole, tokens = build(), torch.randint(0, small_config.vocab_size, (2, 8))
    chunks = {}
    for rank in range(pp):
        network = build()
        rank_chunks, stage_ids = split_into_stages(network, rank, pp, virtual, placement)
        chunks.update(zip(stage_ids, rank_chunks))
        assert {n for n, _ in network.named_parameters()} == {n for c in rank_chunks for n, _ in c.named_parameters()}
    x = tokens
    for stage in range(pp * virtual):
        assert chunks[stage].logit_scale == 0.5
        assert (chunks[stage].out_gain is not None) == (stage == pp * virtual - 1)
        assert (chunks[stage].embed is not None) == (stage == 0)
        x = chunks[stage](x)
    torch.testing.assert_close(x, whole(tokens), rtol=0, atol=0)


def test_a_network_without_blocks_cannot_be_split():
    with pytest.raises(TypeError, match="cuts a network's `blocks` ModuleDict; Linear has none"):
        split_into_stages(torch.nn.Linear(2, 2), rank=0, pp=2, virtual=1)


def test_interleaved_stages_loop_over_ranks_and_v_stages_fold_back():
    assert chunk_stage_ids(rank=1, pp=4, virtual=2) == [1, 5]
    assert chunk_stage_ids(rank=1, pp=4, virtual=2, placement="v") == [1, 6]  # rank 0 holds the first and the last
    for placement in ("loop", "v"):
        assert all(stage_rank(s, 4, placement) == r for r in range(4) for s in chunk_stage_ids(r, 4, 2, placement))


def test_bubble_theory_is_each_papers():
    assert bubble_theory("1f1b", pp=4, microbatches=16) == pytest.approx(3 / 19)
    assert bubble_theory("gpipe", pp=2, microbatches=2) == pytest.approx(1 / 3)
    assert bubble_theory("interleaved_1f1b", pp=4, microbatches=16, virtual=2) == pytest.approx(3 / 35)
    # At F = B = W: ZB-H1 idles a third of 1F1B; interleaved over two chunks, half that; ZB-V only fills its V
    # ((p-1) F / 2, the paper's "zero"); DualPipe-V, whose pairs PyTorch runs one half after the other, as ZB-H1.
    one_f_one_b = idle_time("1f1b", 4)
    assert idle_time("zero_bubble", 4) == pytest.approx(one_f_one_b / 3)
    assert idle_time("zero_bubble", 4, virtual=2) == idle_time("zbv", 4) == pytest.approx(one_f_one_b / 6)
    assert idle_time("dualpipev", 4) == idle_time("zero_bubble", 4)
    assert bubble_theory("zbv", pp=4, microbatches=8) == pytest.approx(1.5 / (24 + 1.5))
    # Activation checkpointing runs each backward whole: no weight gradient is left to fill the bubbles.
    checkpointed = Costs.of("full")
    assert (checkpointed.forward, checkpointed.input_grad, checkpointed.weight_grad) == (1.0, 3.0, 0.0)
    assert idle_time("zero_bubble", 4, costs=checkpointed) == idle_time("1f1b", 4, costs=checkpointed)


def test_peak_activations_in_flight_are_each_papers():
    assert [peak_in_flight("1f1b", 4, 16, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert [peak_in_flight("interleaved_1f1b", 4, 16, 2, r) for r in range(4)] == [5.5, 4.5, 3.5, 2.5]
    assert [peak_in_flight("zero_bubble", 4, 16, 1, r) for r in range(4)] == [4] * 4  # ZB-H1: 1F1B's peak
    assert [peak_in_flight("zbv", 4, 16, 2, r) for r in range(4)] == [4] * 4  # ZB-V: 1F1B's peak
    assert [peak_in_flight("dualpipev", 4, 16, 2, r) for r in range(4)] == [4.5] * 4  # DualPipe: PP + 1 chunks


def pipeline_replay():
    """benchmarks/pipeline_replay.py, which the benchmark and these tests share."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline_replay.py"
    spec = importlib.util.spec_from_file_location("pipeline_replay", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytorch_order(schedule: str, pp: int, m: int, virtual: int) -> dict:
    """Every rank's actions as PyTorch's schedule orders them, planned without a process group."""
    import torch.distributed.pipelining as pipelining

    spec = SCHEDULES[schedule]

    class Stage:  # what a schedule reads of its stages to plan its order
        def __init__(self, index: int) -> None:
            self.stage_index, self.num_stages, self.group_size, self.group_rank = index, pp * virtual, pp, 0
            self.is_first, self.is_last, self.submod = index == 0, index == pp * virtual - 1, torch.nn.Identity()

    stages = [Stage(s) for s in chunk_stage_ids(0, pp, virtual, spec.placement)]
    made = getattr(pipelining, spec.torch_class)(stages if spec.chunks != 1 else stages[0], n_microbatches=m)
    return pipeline_replay().order_of(made, schedule, pp, m)


@pytest.mark.parametrize(
    "schedule, virtual",
    [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1), ("zero_bubble", 2), ("zbv", 2),
     ("dualpipev", 2)],
)  # fmt: skip
@pytest.mark.parametrize("costs", [Costs(), Costs.of("full"), Costs.of("selective")])
def test_theory_is_what_pytorchs_own_order_gives(schedule, virtual, costs):
    """A replay of the schedule's order with free communication (benchmarks/pipeline_bubble.py) idles exactly as
    the theory says, once the pipeline fills; DualPipe-V's formula is the paper's, at most F/2 above the replay when
    the backward outweighs the forward."""
    replay, nominal = pipeline_replay().replay, pipeline_replay().nominal
    for pp in (2, 4):
        for m in (2 * pp, 4 * pp):
            per_chunk = (costs.forward / virtual, costs.input_grad / virtual, costs.weight_grad / virtual)
            replayed = replay(pytorch_order(schedule, pp, m, virtual), pp * virtual, nominal(*per_chunk))[0]
            work = m * (costs.forward + costs.input_grad + costs.weight_grad)
            idle = replayed * work / (1 - replayed)
            theory = idle_time(schedule, pp, virtual, costs)
            slack = costs.forward / 2 if schedule == "dualpipev" and costs.input_grad > costs.forward else 0.0
            assert theory - slack - 1e-9 <= idle <= theory + 1e-9, (pp, m, idle, theory)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pipeline_parallel_size=2, virtual_pipeline_size=2), "virtual_pipeline_size=2 needs pipeline_schedule="),
        (
            dict(pipeline_parallel_size=4, num_microbatches=2),
            "'1f1b' needs num_microbatches >= pipeline_parallel_size=4",
        ),
        (
            dict(
                pipeline_parallel_size=4,
                num_microbatches=9,
                pipeline_schedule="interleaved_1f1b",
                virtual_pipeline_size=2,
            ),
            "needs num_microbatches=9 to be a multiple of pipeline_parallel_size=4",
        ),
        (
            dict(pipeline_parallel_size=2, virtual_pipeline_size=0, pipeline_schedule="zero_bubble"),
            "virtual_pipeline_size=0 must be a positive integer",
        ),
        (
            dict(pipeline_parallel_size=2, virtual_pipeline_size=3, pipeline_schedule="zbv"),
            "pipeline_schedule='zbv' runs exactly 2 chunks per rank .* virtual_pipeline_size=3 cannot be",
        ),
        (
            dict(pipeline_parallel_size=2, num_microbatches=3, pipeline_schedule="dualpipev"),
            "'dualpipev' needs num_microbatches >= 2 x pipeline_parallel_size = 4 .* got 3",
        ),
        (
            dict(pipeline_parallel_size=2, pipeline_schedule="zbv", compile=True),
            "compile=True cannot run pipeline_schedule='zbv': its backward is split",
        ),
        (
            dict(pipeline_parallel_size=2, pipeline_schedule="dualpipev", zero_stage=3),
            "zero_stage=3 cannot run pipeline_schedule='dualpipev': ZeRO-3 reshards each block after its forward",
        ),
    ],
)
def test_bad_pipeline_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Parallel3DStrategy(**kwargs)


def test_a_model_too_shallow_or_tied_is_refused():
    with pytest.raises(ValueError, match=r"= 8 stages, but the model has only n_layer=4 blocks"):
        check_model_fits_pipeline(GPTConfig(n_layer=4), pp=4, virtual=2)
    with pytest.raises(ValueError, match="tie_embeddings=True with pipeline_parallel_size > 1"):
        check_model_fits_pipeline(GPTConfig(n_layer=4, tie_embeddings=True), pp=2, virtual=1)


def test_interleaved_1f1b_interleaves_by_default_and_says_so():
    # One chunk per rank would be plain 1F1B under the interleaved name (its bubble, 0.2 at p=2, m=4, not 1/17).
    strategy = Parallel3DStrategy(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b")
    assert strategy.parallelism.chunks_per_rank == 2
    assert (
        Parallel3DStrategy(pipeline_parallel_size=2, pipeline_schedule="zero_bubble").parallelism.chunks_per_rank == 1
    )
    line = describe_schedule("interleaved_1f1b", 2, 8, 2)
    assert "interleaved_1f1b over 2 ranks, 2 chunk(s) per rank (4 stages), 8 micro-batches" in line
    assert f"bubble {1 / 17:.3f}" in line
    with pytest.raises(ValueError, match=r"virtual_pipeline_size=2 \(interleaved_1f1b's default\) = 4 stages"):
        check_model_fits_pipeline(GPTConfig(n_layer=1), pp=2, virtual=2, schedule="interleaved_1f1b")


def test_default_microbatches_divide_the_batch_and_suit_the_schedule():
    assert default_microbatches(8, pp=2, virtual=1, schedule="1f1b") == 4
    assert default_microbatches(6, pp=2, virtual=1, schedule="1f1b") == 3
    assert default_microbatches(8, pp=4, virtual=2, schedule="interleaved_1f1b") == 8
    assert default_microbatches(8, pp=2, virtual=2, schedule="dualpipev") == 8
    assert default_microbatches(6, pp=2, virtual=2, schedule="dualpipev") == 6  # at least 2p = 4
    with pytest.raises(ValueError, match="per-replica batch of 2 sequences is too small"):
        default_microbatches(2, pp=4, virtual=1, schedule="1f1b")


@pytest.mark.parametrize(
    "layout, theory",
    [("pp2_1f1b", 1 / 5), ("pp4_1f1b", 3 / 11), ("pp2_interleaved_1f1b", 1 / 17), ("pp2_zbv", 0.5 / 24.5)],
)
def test_each_step_logs_the_measured_bubble_next_to_the_theory(layout, theory, layout_runs):
    # Per-replica batch 8: m = 4 for pp2, 8 for pp4 and for two chunks per rank. ZBV at F = B = W idles only to fill
    # its V: (p-1) F / 2 against m (F + B + W) of work.
    run = layout_runs[layout]
    assert run["pp_bubble_theory"] == pytest.approx([theory] * STEPS)
    assert len(run["pp_bubble"]) == STEPS and all(0.0 <= b < 1.0 for b in run["pp_bubble"])


@pytest.mark.ranks
def test_the_bubble_benchmark_measures_what_a_replay_of_its_own_timings_gives(tmp_path):
    """`benchmarks/pipeline_bubble.py` on 2 ranks: each schedule's measured bubble is the replay of its order with the
    durations and pauses it measured, and its peak of micro-batches in flight is the theory's."""
    out = tmp_path / "bubble.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline_bubble.py"
    argv = [sys.executable, str(script), "--stages", "2", "--microbatches", "4", "--schedules", "1f1b", "zbv"]
    run = forked.run([*argv, "--steps", "2", "--json", str(out)], cwd=tmp_path, env=dict(os.environ), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(out.read_text())}
    assert sorted(rows) == ["1f1b", "zbv"]
    for row in rows.values():
        assert row["measured"] == pytest.approx(row["replay_measured"], abs=0.05), row
        assert row["peak"] == row["peak_theory"], row
