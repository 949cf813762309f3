"""Pipeline parallelism: the stage split, the schedules' constraints, and what a step reports."""

import pytest
import torch

from lit3d import GPTConfig
from lit3d.model import Transformer
from lit3d.strategies import Parallel3DStrategy
from lit3d.strategies.layout import check_model_fits_pipeline, default_microbatches
from lit3d.strategies.pipeline import bubble_theory
from lit3d.strategies.stages import block_costs, chunk_stage_ids, partition, split_into_stages


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


@pytest.mark.parametrize("pp, virtual", [(2, 1), (2, 2), (4, 1)])
def test_stages_run_in_order_compute_the_whole_network(small_config, pp, virtual):
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
        rank_chunks, stage_ids = split_into_stages(network, rank, pp, virtual)
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


def test_interleaved_stages_loop_over_ranks():
    assert chunk_stage_ids(rank=1, pp=4, virtual=2) == [1, 5]


def test_bubble_theory():
    assert bubble_theory("1f1b", pp=4, microbatches=16) == pytest.approx(3 / 19)
    assert bubble_theory("gpipe", pp=2, microbatches=2) == pytest.approx(1 / 3)
    assert bubble_theory("interleaved_1f1b", pp=4, microbatches=16, virtual=2) == pytest.approx(3 / 35)
    assert bubble_theory("zero_bubble", pp=4, microbatches=16, virtual=2) == 0.0


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


def test_default_microbatches_divide_the_batch_and_suit_the_schedule():
    assert default_microbatches(8, pp=2, virtual=1, schedule="1f1b") == 4
    assert default_microbatches(6, pp=2, virtual=1, schedule="1f1b") == 3
    assert default_microbatches(8, pp=4, virtual=2, schedule="interleaved_1f1b") == 8
    with pytest.raises(ValueError, match="per-replica batch of 2 sequences is too small"):
        default_microbatches(2, pp=4, virtual=1, schedule="1f1b")


@pytest.mark.parametrize(
    "layout, theory", [("pp2_1f1b", 1 / 5), ("pp4_1f1b", 3 / 11), ("pp2_interleaved_1f1b", 1 / 17)]
)
def test_each_step_logs_the_measured_bubble_next_to_the_theory(layout, theory, layout_runs):
    run = layout_runs[layout]  # per-replica batch 8: m = 4 for pp2, 8 for pp4 and for pp2 x 2 virtual (v·m = 16)
    assert run["pp_bubble_theory"] == pytest.approx([theory] * 8)
    assert len(run["pp_bubble"]) == 8 and all(0.0 <= b < 1.0 for b in run["pp_bubble"])
