"""Mixture of Experts: the layer against a token-by-token reference, its balance loss and router, the presets, the
checks, and expert parallelism (with TP and SP) training exactly like one process."""

import math

import pytest
import torch
import torch.nn.functional as F
from layouts import FALLS, HALF, MOE_LAYOUTS, SMALL_MOE, STEPS

from lit3d import GPTConfig
from lit3d.models.moe import MoE, balance_loss, grouped_mm
from lit3d.models.tp_plan import tensor_parallel_plan
from lit3d.models.transformer import Transformer
from lit3d.parallel.layout import Layout, check_model_fits_layout, resolve_layout
from lit3d.parallel.rank_map import rank_map

CONFIG = GPTConfig(**{**SMALL_MOE, "n_shared_experts": 1})


def token_by_token(config: GPTConfig, seq: int, capacity: float = math.inf) -> tuple[MoE, torch.Tensor, int]:
    """An MoE layer with random weights, checked on random tokens against a token-by-token reference in which each
    expert takes its (token, choice) pairs in token order up to ``capacity``; returns the layer, its tokens and how
    many pairs the cap dropped."""
    torch.manual_seed(0)
    layer = MoE(config)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.1)
    x = torch.randn(2, seq, config.d_model)
    out = layer(x).reshape(-1, config.d_model)
    tokens = x.reshape(-1, config.d_model)
    chosen, weights, _ = layer.router(tokens)
    experts, taken, dropped = layer.experts, [0] * config.n_expert, 0
    for i, token in enumerate(tokens):
        expected = layer.shared(token) if layer.shared is not None else torch.zeros(config.d_model)
        for e, w in zip(chosen[i].tolist(), weights[i]):
            taken[e] += 1
            if taken[e] > capacity:
                dropped += 1
                continue
            hidden = F.silu(token @ experts.gate_proj[e]) * (token @ experts.up_proj[e])
            expected = expected + w * (hidden @ experts.down_proj[e])
        torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-6)
    return layer, tokens, dropped


def test_the_layer_sums_each_tokens_chosen_experts_by_their_weights():
    layer, tokens, dropped = token_by_token(CONFIG, seq=5)
    assert dropped == 0 and layer.stats[1].sum() == tokens.shape[0] * CONFIG.n_expert_per_token  # each choice once


def test_a_capacity_factor_drops_the_pairs_beyond_each_experts_capacity():
    config = CONFIG.replace(n_shared_experts=0, capacity_factor=0.5)
    pairs = 2 * 8 * config.n_expert_per_token
    _, _, dropped = token_by_token(config, seq=8, capacity=math.ceil(0.5 * pairs / config.n_expert))  # 4 each
    assert dropped > 0  # the cap did bite


def test_grouped_matmul_fallback_multiplies_each_group_by_its_weight():
    x, weight = torch.randn(7, 3), torch.randn(3, 3, 4)
    counts = [2, 0, 5]
    expected = torch.cat([x[:2] @ weight[0], x[2:] @ weight[2]])
    torch.testing.assert_close(grouped_mm(x, weight, counts), expected)


def test_balance_loss_is_one_for_an_even_load_and_n_expert_when_one_expert_takes_all():
    n_expert, seq = 4, 8
    even_scores = torch.full((seq, n_expert), 1 / n_expert)
    even_choice = torch.arange(seq).remainder(n_expert)[:, None]
    assert balance_loss(even_scores, even_choice, n_expert, seq).item() == pytest.approx(1.0)
    collapsed_scores = torch.nn.functional.one_hot(torch.zeros(seq, dtype=torch.long), n_expert).float()
    collapsed_choice = torch.zeros(seq, 1, dtype=torch.long)
    assert balance_loss(collapsed_scores, collapsed_choice, n_expert, seq).item() == pytest.approx(n_expert)


def test_balance_loss_is_per_sequence_so_splitting_the_batch_does_not_change_it():
    torch.manual_seed(0)
    scores, chosen = torch.rand(4 * 6, 4).softmax(-1), torch.randint(0, 4, (4 * 6, 2))
    whole = balance_loss(scores, chosen, 4, 6)
    halves = [balance_loss(scores[i : i + 12], chosen[i : i + 12], 4, 6) for i in (0, 12)]
    assert whole.item() == pytest.approx(sum(halves).item() / 2)


def test_sigmoid_router_bias_moves_toward_the_underloaded_experts():
    layer = MoE(CONFIG.replace(router="sigmoid"))
    layer.router.update_bias(torch.tensor([10, 0, 5, 5]), rate=0.1)
    assert layer.router.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])


@pytest.mark.parametrize(
    "name, total, active",
    [("mixtral-8x7b", 46.7e9, 12.9e9), ("mixtral-8x22b", 140.6e9, 39.2e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9),
     ("qwen3-235b-a22b", 235.1e9, 22.2e9)],
)  # fmt: skip
def test_moe_presets_have_the_published_parameter_counts(name, total, active):
    config = GPTConfig.from_name(name)  # the model cards round to three digits, or two (3.3B)
    assert config.num_params == pytest.approx(total, rel=0.01)
    assert config.active_params == pytest.approx(active, rel=0.02)


def test_bad_moe_settings_are_refused_naming_the_values():
    with pytest.raises(ValueError, match="n_expert_per_token=5 must be between 1 and n_expert=4"):
        GPTConfig(**{**SMALL_MOE, "n_expert_per_token": 5})
    with pytest.raises(ValueError, match="router='top1'"):
        GPTConfig(**{**SMALL_MOE, "router": "top1"})
    with pytest.raises(ValueError, match="expert_parallel_size=3 does not divide data_parallel_size=4"):
        resolve_layout(4, 4, "auto", 1, 1, 3)
    with pytest.raises(ValueError, match="expert_parallel_size=8 does not divide n_expert=4"):
        check_model_fits_layout(GPTConfig(**SMALL_MOE), Layout(dp=8, tp=1, pp=1, devices_per_node=8, ep=8))
    with pytest.raises(ValueError, match="a dense model has no experts"):
        check_model_fits_layout(GPTConfig(), Layout(dp=2, tp=1, pp=1, devices_per_node=2, ep=2))


def test_moe_blocks_are_replicated_regions_under_tensor_parallelism():
    plan = tensor_parallel_plan(GPTConfig(**SMALL_MOE))
    assert plan["blocks.0.mlp"] == "tp_region" and plan["blocks.0.mlp.gate_proj"] == "colwise"
    assert plan["blocks.1.mlp"] == "replicated_region" and "blocks.1.mlp.gate_proj" not in plan
    assert plan["blocks.*.mlp_norm"] == "norm"  # the norm before the experts still runs on sequence shards
    Transformer(GPTConfig(**SMALL_MOE))  # the plan names modules the network has


def test_the_rank_map_shows_expert_parallel_groups():
    text = rank_map(Layout(dp=4, tp=1, pp=1, devices_per_node=4, ep=2))
    assert "expert-parallel of 2" in text and "0, part 2/2" in text and "1, part 1/2" in text


@pytest.mark.parametrize("layout", [name for name in MOE_LAYOUTS if not name.endswith("_comms")])
def test_moe_layout_matches_the_single_process_curve_and_balance(layout, layout_runs, reference_moe_run):
    run, reference = layout_runs[layout], reference_moe_run
    assert len(reference["losses"]) == STEPS and reference["losses"][-1] < reference["losses"][0] - FALLS
    for key in ("losses", "aux_loss", "load_imbalance"):
        assert len(run[key]) == len(reference[key]) == STEPS
        assert max(abs(a - b) / abs(b) for a, b in zip(run[key], reference[key])) <= 1e-5, key
    assert all(1.0 <= x <= SMALL_MOE["n_expert"] for x in reference["aux_loss"])


@pytest.fixture(scope="module")
def moe_saved(base_job, tmp_path_factory) -> dict:
    """The MoE model at EP2 checkpointing after step `HALF`, resumed from there at TP2 (no EP) and on one process."""
    from layouts import merge
    from spawned import run_jobs

    base = merge(base_job, {"model": {"config": SMALL_MOE}, "trainer": {"limit_val_batches": 0}})
    out = tmp_path_factory.mktemp("moe_checkpoints")
    saved = str(out / "ep2" / "ckpts" / f"step={HALF}.ckpt")
    results = run_jobs(2, {
        "ep2": merge(base, {"strategy": {"expert_parallel_size": 2}, "checkpoint_at": HALF}),
        "resume_tp2": merge(base, {"strategy": {"tensor_parallel_size": 2}, "ckpt_path": saved}),
    }, out)  # fmt: skip
    results.update(run_jobs(1, {"resume_single": merge(base, {"strategy": {}, "ckpt_path": saved})}, out))
    return results


@pytest.mark.parametrize("layout", ["resume_tp2", "resume_single"])
def test_a_checkpoint_saved_with_expert_parallelism_resumes_in_another_layout(moe_saved, layout):
    uninterrupted, resumed = moe_saved["ep2"], moe_saved[layout]
    for key in ("losses", "aux_loss"):
        assert len(uninterrupted[key]) == STEPS and len(resumed[key]) == STEPS - HALF
        assert max(abs(a - b) / abs(b) for a, b in zip(resumed[key], uninterrupted[key][HALF:])) <= 1e-5, key


def test_expert_parallel_all_to_alls_send_what_the_planner_counts(layout_runs):
    """DP2 (as EP2) x TP2 + SP, every token to every expert: bytes per axis, measured, equal the planner's."""
    comm = layout_runs["moe_dp2_ep2_tp2_sequence_parallel_comms"]["comm_bytes"]
    measured, planned = comm["measured"], comm["planned"]
    assert planned["ep"] > 0 and planned["tp"] > 0 and planned["dp"] > 0
    for axis in ("ep", "tp", "dp", "pp"):
        assert planned[axis] <= measured[axis] <= planned[axis] + 256, (axis, measured, planned)


def test_the_planner_splits_an_moe_model_with_expert_parallelism():
    from lit3d.planner import Cluster, Training, search
    from lit3d.planner.search import why

    config, cluster = GPTConfig.from_name("mixtral-8x7b"), Cluster(nodes=8)
    fitting, _ = search(config, cluster, Training(seq_len=4096, global_batch_size=512))
    best = fitting[0]
    assert best.layout.ep > 1 and any(c.layout.ep > 1 and c.layout.pp > 1 for c in fitting)  # EP also with PP
    assert "EP" in why(best, cluster) and best.plan.communication_per_step["ep"]["bytes"] > 0
    assert best.plan.params_total == config.num_params and best.plan.params_active == config.active_params
    # compute follows the active parameters: 12.9B of 46.7B
    assert best.plan.flops_per_step == pytest.approx(config.flops_per_token(4096) * 512 * 4096)
    assert config.flops_per_token(4096) < 0.3 * GPTConfig.from_name(
        "mixtral-8x7b", n_expert_per_token=8
    ).flops_per_token(4096)


def _random_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=64, rope_theta=1e6, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=None, router_jitter_noise=0.0,
    )  # fmt: skip
    return MixtralForCausalLM(config).eval()


def test_a_huggingface_mixtral_imports_and_exports_with_the_same_logits(tmp_path):
    from transformers import MixtralForCausalLM

    from lit3d import GPT
    from lit3d.hf.folders import write_folder

    reference = _random_mixtral()
    reference.save_pretrained(tmp_path / "hf")
    model = GPT.from_pretrained(str(tmp_path / "hf"))
    config = model.config
    assert (config.n_expert, config.n_expert_per_token, config.d_ff_expert, config.rope_theta) == (4, 2, 48, 1e6)
    tokens = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=1e-4, atol=1e-4)
    # Back out, one matrix per expert as the published Mixtral checkpoints hold them, and in again.
    write_folder(tmp_path / "out", config, model.model.state_dict())
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in f.keys()
    exported = MixtralForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    again = GPT.from_pretrained(str(tmp_path / "out"))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, reference(tokens).logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(again(tokens), model(tokens), rtol=0, atol=0)


def test_moe_models_mixtral_cannot_hold_are_not_exported_as_mixtral():
    from lit3d.hf.folders import config_to_hf

    with pytest.raises(ValueError, match="first_dense_layers"):
        config_to_hf(GPTConfig(**SMALL_MOE), torch.float32)


@pytest.mark.gpu
def test_grouped_gemm_on_the_gpu_matches_the_per_group_loop():
    """The CUDA path of `grouped_mm` (PyTorch's grouped GEMM, bf16, Hopper and later) against the CPU loop."""
    from lit3d.models.moe import _has_grouped_gemm

    x = torch.randn(96, 64, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4, 64, 32, device="cuda", dtype=torch.bfloat16)
    if not _has_grouped_gemm(x, weight):
        pytest.skip("this GPU or PyTorch build has no grouped GEMM")
    counts = [16, 32, 0, 48]
    expected = grouped_mm(x.cpu().float(), weight.cpu().float(), counts)
    torch.testing.assert_close(grouped_mm(x, weight, counts).cpu().float(), expected, rtol=2e-2, atol=2e-2)
