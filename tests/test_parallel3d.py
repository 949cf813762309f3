"""The 3D strategy: every layout trains exactly like one process (fp32), and validates like it."""

import math

import pytest
import torch
from layouts import COMM_MEASURED, FALLS, LAYOUTS, SMALL_GPT, STEPS, is_deep

from lit3d import GPTConfig

FP32_LAYOUTS = [
    n
    for n, (_, job) in LAYOUTS.items()
    if "precision" not in job.get("trainer", {})
    and not job.get("plain_loader")
    and not job.get("count_comms")
    and not job.get("unseeded")
]


def relative_difference(losses, reference):
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def reference_of(layout: str, request) -> dict:
    """The single-process run ``layout`` compares with: of the 4-block model for the layouts of 4 stages."""
    return request.getfixturevalue("reference_deep_run" if is_deep(LAYOUTS[layout][1]) else "reference_run")


@pytest.mark.parametrize("layout", FP32_LAYOUTS)
def test_layout_matches_the_single_process_loss_curve(layout, layout_runs, request):
    losses, reference = layout_runs[layout]["losses"], reference_of(layout, request)["losses"]
    assert len(reference) == STEPS and len(losses) == STEPS
    assert reference[-1] < reference[0] - FALLS  # it is learning, so the curves are worth comparing
    assert relative_difference(losses, reference) <= 1e-5


@pytest.mark.parametrize("layout", [n for n in FP32_LAYOUTS if "accumulate" not in n])
def test_layout_matches_the_single_process_val_loss(layout, layout_runs, request):
    # Same validation blocks in every layout (an accumulating run's micro-batches are smaller, so it covers fewer).
    val, reference = layout_runs[layout]["val_loss"], reference_of(layout, request)["val_loss"]
    assert len(reference) == 1 and len(val) == 1  # after the last step
    assert relative_difference(val, reference) <= 1e-5


@pytest.mark.parametrize("layout", [n for n in LAYOUTS if "bf16-true" in n])
def test_bf16_true_trains_at_every_zero_stage(layout, layout_runs, reference_run):
    losses = layout_runs[layout]["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert relative_difference(losses, reference_run["losses"]) < 0.05


BF16_MIXED = [n for n in LAYOUTS if "bf16-mixed" in n]


@pytest.mark.parametrize("layout", BF16_MIXED)
def test_bf16_mixed_follows_the_single_process_bf16_mixed_curve(layout, layout_runs, reference_bf16_run):
    losses, reference = layout_runs[layout]["losses"], reference_bf16_run["losses"]
    assert len(losses) == len(reference) == STEPS and reference[-1] < reference[0] - FALLS
    assert relative_difference(losses, reference) <= 1e-2


@pytest.mark.parametrize("layout", BF16_MIXED)
def test_bf16_mixed_sends_what_the_planner_counts(layout, layout_runs):
    """Per axis, in bf16 where the planner says so: parameter gathers, TP's activations and PP's sends."""
    comm = layout_runs[layout]["comm_bytes"]
    measured, planned = comm["measured"], comm["planned"]
    assert sum(planned.values()) > 0
    for axis in ("dp", "tp", "pp"):
        assert planned[axis] <= measured[axis] <= planned[axis] + 256, (axis, measured, planned)


def test_bf16_mixed_gathers_parameters_in_bf16(layout_runs):
    # FSDP2 gathers bf16 parameters and reduces fp32 gradients: of ZeRO-3's fp32 bytes, the gradients' share
    # (what ZeRO-0's all-reduce sends, halved) stays and the gathers' halves; about 2/3 in all when the blocks
    # dominate (0.69 for this small model, whose embedding and head are gathered once per micro-batch, not twice).
    # With bf16 reduction, everything halves.
    dp = {name: layout_runs[name]["comm_bytes"]["measured"]["dp"] for name in LAYOUTS if name.startswith("dp2_zero")
          and "comm_bytes" in layout_runs[name]}  # fmt: skip
    reduce_scatter = dp["dp2_zero0"] / 2
    gathers = dp["dp2_zero3"] - reduce_scatter
    assert abs(dp["dp2_zero3_bf16-mixed"] - (reduce_scatter + gathers / 2)) <= 256
    assert dp["dp2_zero3_bf16-mixed_reduce_bf16"] / dp["dp2_zero3"] == pytest.approx(1 / 2, abs=1e-3)
    assert dp["dp2_zero0_bf16-mixed_reduce_bf16"] / dp["dp2_zero0"] == pytest.approx(1 / 2, abs=1e-3)
    # ZeRO-1 reduce-scatters the fp32 gradients as DDP all-reduces them, and all-gathers the bf16 parameters: 3/4
    assert abs(dp["dp2_zero1_bf16-mixed"] - dp["dp2_zero0_bf16-mixed"] * 3 / 4) <= 256


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_no_gradient_sync_on_micro_steps_before_the_last(layout_runs, zero_stage):
    comms = layout_runs[f"dp2_zero{zero_stage}_accumulate2_comms"]["comms"]  # per batch: 2 steps x 2 micro-steps
    assert len(comms) == 4
    firsts, lasts = comms[0::2], comms[1::2]
    if zero_stage == 0:
        # DDP: one bucket holds the whole small model's gradients, plus the logged loss. Once, at the start of the
        # second step, DDP agrees on its rebuilt bucket order (broadcasts); no gradients move.
        assert firsts == [{}, {"c10d.broadcast_": 2}], f"gradients synced on a non-final micro-step: {firsts}"
        assert lasts == [{"c10d.allreduce_": 2}] * 2
    else:
        # ZeRO-1: one reduce-scatter of all the gradients (one bucket), the logged loss, the gradient norm of the
        # slices for clipping, then one all-gather of the updated slices; on CPU both as all-to-alls (zero.py).
        assert firsts == [{}, {}], f"collectives on a non-final micro-step: {firsts}"
        expected = {"c10d.alltoall_base_": 2, "c10d.allreduce_": 2}
        assert lasts == [expected] * 2


def test_zero1_sends_what_ddp_sends(layout_runs):
    # The ZeRO paper's P_os: a reduce-scatter of the gradients and an all-gather of the updated slices, 2 (D-1)/D
    # of the model's bytes, as DDP's all-reduce.
    zero0, zero1 = (layout_runs[f"dp2_zero{z}"]["comm_bytes"]["measured"]["dp"] for z in (0, 1))
    assert zero0 > 0 and abs(zero1 - zero0) <= 256, (zero0, zero1)


@pytest.mark.parametrize("layout", COMM_MEASURED)
def test_measured_communication_per_axis_matches_the_planner(layout, layout_runs):
    """Bytes each axis sends in one step, under CommDebugMode, against `lit3d.planner`'s formula."""
    strategy = LAYOUTS[layout][1]["strategy"]
    comm = layout_runs[layout]["comm_bytes"]
    measured, planned = comm["measured"], comm["planned"]
    sizes = {
        "tp": strategy.get("tensor_parallel_size", 1),
        "pp": strategy.get("pipeline_parallel_size", 1),
        "dp": LAYOUTS[layout][0]
        // strategy.get("tensor_parallel_size", 1)
        // strategy.get("pipeline_parallel_size", 1),
    }
    for axis, size in sizes.items():
        assert (planned[axis] > 0) == (size > 1), (axis, planned)
        # The planner leaves out only scalars (the logged loss, the gradient norm's partial sums).
        assert planned[axis] <= measured[axis] <= planned[axis] + 256, (axis, measured, planned)
    assert measured["other"] <= 64  # nothing big outside the mesh's groups


@pytest.mark.parametrize("layout", [n for n, (_, job) in LAYOUTS.items() if job.get("validate_after_fit")])
def test_validate_after_fit_in_the_same_processes_uses_the_trained_split_model(layout, layout_runs):
    # As under torchrun: fit, then validate with the same trainer; the strategy does not split the model again.
    run = layout_runs[layout]
    assert run["validate_after_fit"] == pytest.approx(run["val_loss"][-1], rel=1e-6)


def test_ranks_seeded_apart_still_start_from_the_same_weights(layout_runs):
    # Without seed_everything each process has its own seed; the strategy takes rank 0's, so the replicas agree.
    ranks = layout_runs["dp2_zero0_unseeded"]["ranks"]
    assert ranks[0]["param_sum"] == ranks[1]["param_sum"]


def test_train_loss_is_logged_once_per_step_with_the_global_mean(layout_runs, reference_run):
    # One row per optimizer step, and the value is the whole global batch's mean: it equals the reference.
    run = layout_runs["dp2_zero3_accumulate2"]
    assert len(run["losses"]) == STEPS
    assert relative_difference(run["losses"], reference_run["losses"]) <= 1e-5


def test_lightning_injects_a_sampler_over_the_data_parallel_ranks_only(layout_runs):
    ranks = layout_runs["dp2_tp2_plain_loader"]["ranks"]
    assert [r["sampler"]["type"] for r in ranks] == ["DistributedSampler"] * 4
    # TP-innermost: ranks 0,1 are replica 0 and ranks 2,3 replica 1 (never the global rank).
    assert [(r["sampler"]["num_replicas"], r["sampler"]["rank"]) for r in ranks] == [(2, 0), (2, 0), (2, 1), (2, 1)]


def test_memory_per_rank_follows_the_zero_formula(layout_runs):
    config = GPTConfig(**SMALL_GPT)
    names_and_sizes = _parameter_sizes(config)
    full = 4 * sum(names_and_sizes.values())  # fp32 bytes of the whole model
    steps = 4 * len(names_and_sizes)  # AdamW keeps one fp32 step counter per tensor
    expected = {  # (params, grads, optimizer) on each of 2 data-parallel ranks
        0: (full, full, 2 * full + steps),
        1: (full, full // 2, full + steps),  # exp_avg and exp_avg_sq of half of every tensor, and its gradient
        2: (full // 2, full // 2, full + steps),
        3: (full // 2, full // 2, full + steps),
    }
    for stage, (params, grads, optimizer) in expected.items():
        for report in layout_runs[f"dp2_zero{stage}"]["ranks"]:
            assert (report["memory"]["params"], report["memory"]["grads"], report["memory"]["optimizer"]) == (
                params,
                grads,
                optimizer,
            ), f"zero_stage={stage}"
    # ZeRO-1 over DP=2 holds half the optimizer state of ZeRO-0 (but for the step counters).
    z0, z1 = (layout_runs[f"dp2_zero{s}"]["memory"]["optimizer"] - steps for s in (0, 1))
    assert z1 * 2 == z0
    # Tensor parallel: matrices split in two, norms replicated.
    norms = 4 * sum(v for k, v in names_and_sizes.items() if "norm" in k)
    tp = layout_runs["tp2"]["memory"]
    assert tp["params"] == tp["grads"] == (full - norms) // 2 + norms


def _parameter_sizes(config):
    from lit3d.models.transformer import Transformer

    with torch.device("meta"):
        return {name: p.numel() for name, p in Transformer(config).named_parameters()}
