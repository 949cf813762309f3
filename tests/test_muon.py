"""Muon (`lit3d.models.muon`): its update against ``torch.optim.Muon``'s, which parameters it steps, and what is
refused with it, by name; its layouts (tests/muon_layouts.py) against one process."""

import math

import pytest
import torch
from layouts import FALLS, HALF, SMALL_GPT, SMALL_MOE, STEPS, is_deep
from muon_layouts import MUON_COMMS, MUON_LAYOUTS, MUON_RESUMED

from lit3d import GPT, GPTConfig, LoRA
from lit3d.models.muon import Muon, newton_schulz


@pytest.mark.parametrize("shape", [(48, 32), (32, 48)])
def test_the_update_of_a_hidden_matrix_is_torch_optim_muons(shape):
    """Five steps from the same gradients: bitwise ``torch.optim.Muon`` with Moonshot's RMS matching (bf16 NS,
    its coefficients, its averaged Nesterov momentum, decoupled weight decay)."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(*shape, generator=generator)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    mine = Muon([{"params": [ours], "muon": True}], lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16)  # (a GPU's)
    reference = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(5):
        grad = torch.randn(*shape, generator=generator)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step()
        reference.step()
    assert torch.equal(ours, theirs)


def test_on_a_cpu_the_iteration_runs_in_fp32_unless_told():
    """``muon_ns_dtype="auto"`` (the default): bf16 matrix products are slow on a CPU (50x fp32's here), so a CPU's
    parameters are orthogonalised in fp32, a GPU's in bf16."""
    generator = torch.Generator().manual_seed(2)
    start, grad = torch.randn(24, 40, generator=generator), torch.randn(24, 40, generator=generator)
    steps = {}
    for dtype in (None, torch.float32, torch.bfloat16):
        param = torch.nn.Parameter(start.clone())
        param.grad = grad.clone()
        Muon([{"params": [param], "muon": True}], lr=0.02, ns_dtype=dtype).step()
        steps[dtype] = param.detach()
    assert torch.equal(steps[None], steps[torch.float32]) and not torch.equal(steps[None], steps[torch.bfloat16])
    assert (
        GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, d_ff=32, vocab_size=32), optimizer="muon").muon.ns_dtype
        == "auto"
    )


def test_the_rest_steps_as_torch_optim_adamw():
    generator = torch.Generator().manual_seed(1)
    start = torch.randn(40, generator=generator)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    mine = Muon([{"params": [ours]}], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    reference = torch.optim.AdamW([theirs], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for _ in range(5):
        grad = torch.randn(40, generator=generator)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step()
        reference.step()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)


def test_a_stack_of_experts_is_orthogonalised_expert_by_expert():
    stack = torch.randn(3, 16, 24, generator=torch.Generator().manual_seed(2))
    each = torch.stack([newton_schulz(matrix, dtype=torch.float32) for matrix in stack])
    torch.testing.assert_close(newton_schulz(stack, dtype=torch.float32), each, rtol=0, atol=1e-6)


def test_muon_steps_the_blocks_matrices_and_adamw_the_rest():
    config = dict(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=100, n_expert=4,
                  n_expert_per_token=2, first_dense_layers=1, attention_bias=True)  # fmt: skip
    model = GPT(config, optimizer="muon")
    model.configure_model()
    from lit3d.models.optimizers import build_optimizer

    optimizer = build_optimizer(
        list(model.named_parameters()), "muon", 1e-3, 0.1, (0.9, 0.95), 1e-8, "auto", model.muon
    )
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    rest = {names[id(p)] for g in optimizer.param_groups if not g["muon"] for p in g["params"]}
    assert "model.blocks.0.attn.q_proj.weight" in muon and "model.blocks.1.mlp.experts.gate_proj" in muon
    assert "model.blocks.0.mlp.down_proj.weight" in muon
    for kept in ("model.embed.weight", "model.head.weight", "model.blocks.0.attn_norm.weight",
                 "model.blocks.0.attn.q_proj.bias", "model.blocks.1.mlp.router.gate.weight"):  # fmt: skip
        assert kept in rest
    assert muon | rest == set(names.values()) and not muon & rest


@pytest.mark.parametrize(
    "kwargs, message",
    [({"optimizer": "lion"}, "optimizer='lion': .*one of 'adamw', 'muon'"),
     ({"optimizer": "muon", "muon_momentum": 1.0}, "muon_momentum=1.0 must lie in"),
     ({"optimizer": "muon", "muon_ns_dtype": "float16"}, "muon_ns_dtype='float16' is not one of"),
     ({"optimizer": "muon", "muon_rms_rule": "spectral"}, "muon_rms_rule='spectral' is not one of"),
     ({"optimizer": "muon", "lora": LoRA(rank=4)}, "optimizer='muon' with LoRA adapters")],
)  # fmt: skip
def test_bad_muon_settings_are_refused_when_the_model_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPT("tiny", **kwargs)


def test_zero1_takes_muon_with_experts_sliced_over_the_ranks_that_hold_them():
    """ZeRO-1's slices of a matrix are gathered for its step (`muon_dp2_zero1` trains like one process), and a stack
    of experts that several data-parallel ranks hold, sliced over them, is gathered there expert by expert
    (`muon_moe_dp4_ep2_zero1`): neither is refused."""
    from lit3d.parallel.layout import Layout
    from lit3d.parallel.settings import Parallelism
    from lit3d.strategies.checks import check_run

    check_run(Parallelism(zero_stage=1), Layout(dp=2, tp=1, pp=1, devices_per_node=2), GPT("tiny", optimizer="muon"),
              None, None)  # fmt: skip
    moe = GPT(GPTConfig(**SMALL_MOE), optimizer="muon")
    layout = Layout(dp=4, tp=1, pp=1, ep=2, devices_per_node=4)
    check_run(Parallelism(zero_stage=1, expert_parallel_size=2), layout, moe, None, None)


def test_a_checkpoint_resumes_only_with_the_optimizer_it_trained_with():
    """Muon's momentum is not AdamW's moments: a resume that switches optimizers is refused by name, either way (a
    single file's hyper-parameters here; a checkpoint folder's in tests/test_checkpoint.py)."""
    from pathlib import Path

    from lit3d.checkpoint.folder import check_same_optimizer

    for theirs, ours in (("adamw", "muon"), ("muon", "adamw")):
        with pytest.raises(ValueError, match=f"trained with optimizer='{theirs}', this run with '{ours}'"):
            check_same_optimizer(Path("run.ckpt"), {"hyper_parameters": {"optimizer": theirs}}, ours)
    check_same_optimizer(Path("run.ckpt"), {"hyper_parameters": {}}, "adamw")  # lit3d 0.4's GPT: AdamW's
    with pytest.raises(ValueError, match="trained with optimizer='adamw', this run with 'muon'"):
        check_same_optimizer(Path("run.ckpt"), {"hyper_parameters": {}}, "muon")
    check_same_optimizer(Path("run.ckpt"), {}, None)  # a module that names no optimizer resumes as before


@pytest.mark.parametrize("layout", list(MUON_LAYOUTS))
def test_muon_trains_like_one_process_in_every_layout_that_splits_its_matrices(layout, layout_runs, muon_references):
    """ZeRO-3's and TP's shards gathered for each matrix's step, a pipeline's stages, EP's experts, ZeRO-3 x TP: every
    step's loss and the validation's within 1e-5 of one process's (fp32), which itself learns."""
    kind = "moe" if "moe" in layout else "deep" if is_deep(MUON_LAYOUTS[layout][1]) else "dense"
    kind = "clip" if "clip" in layout else kind
    run, reference = layout_runs[layout], muon_references[kind]
    assert reference["losses"][-1] < reference["losses"][0] - FALLS
    for key in ("losses", "val_loss"):
        assert len(run[key]) == len(reference[key]) > 0, key
        assert max(abs(a - b) for a, b in zip(run[key], reference[key])) <= 1e-5, (key, run[key], reference[key])


@pytest.mark.parametrize("layout", list(MUON_RESUMED))
def test_muons_momentum_saved_in_one_layout_resumes_in_another_on_the_same_curve(layout, layout_runs, muon_references):
    """The checkpoint of step `HALF` at DP2 x TP2 x ZeRO-3 (each momentum a shard of its matrix over both) resumed at
    DP2 x PP2, and TP2's resumed at ZeRO-3: every later step's loss and the validation's within 1e-5 of one process's.
    The last step's update and the validation after it move with the momentum carried over (a fresh one would change
    them)."""
    run, reference = layout_runs[layout], muon_references["dense"]
    assert len(run["losses"]) == STEPS - HALF and len(run["val_loss"]) == len(reference["val_loss"]) > 0
    for got, expected in ((run["losses"], reference["losses"][HALF:]), (run["val_loss"], reference["val_loss"])):
        assert max(abs(a - b) for a, b in zip(got, expected)) <= 1e-5, (layout, got, expected)


def test_the_planner_holds_muons_matrices_at_one_momentum_against_adamws_two(capsys):
    """Llama 3 70B at TP8 x DP8, ZeRO-3 (``lit3d plan --optimizer muon``): the optimizer's state about half AdamW's
    (every matrix of the blocks keeps one fp32 momentum; the embedding, head and norms stay on AdamW)."""
    import json

    from lit3d.cli import main

    flags = ["plan", "--model", "llama-70b", "--nodes", "8", "--tensor_parallel_size", "8", "--pipeline_parallel_size",
             "1", "--zero_stage", "3", "--json"]  # fmt: skip
    main(flags)
    adamw = json.loads(capsys.readouterr().out)["memory_per_gpu"]["optimizer"]
    main([*flags, "--optimizer", "muon"])
    muon = json.loads(capsys.readouterr().out)["memory_per_gpu"]["optimizer"]
    assert 0.5 < muon / adamw < 0.53


@pytest.mark.parametrize("layout", MUON_COMMS)
def test_a_muon_step_sends_what_the_planner_counts(layout, layout_runs):
    """The bytes of one step per axis (`lit3d.CommReport`) against the planner's, Muon's gathers included: ZeRO-1,
    ZeRO-3 and TP gather each matrix Muon steps whole once a step, over and above what the same layout sends with AdamW
    (half of the matrices' fp32 bytes over 2 ranks); an expert is orthogonalised where it is, so EP sends nothing
    more, but for ZeRO-1's slices of it over the ranks that hold it (DP4 x EP2: half of each over ``dp``)."""
    from lit3d.models.optimizer_settings import is_hidden_matrix
    from lit3d.models.transformer import Transformer

    comm = layout_runs[layout]["comm_bytes"]
    measured, planned = comm["measured"], comm["planned"]
    assert sum(planned.values()) > 0
    for axis in planned:  # (the planner leaves out scalars: the logged loss, the gradient norm)
        if axis == "ep":  # the tokens' all-to-alls: the planner counts an even load (measured: 0.8 % more here);
            # gathering the experts would have added more than all of them (half of the MoE blocks' expert stacks)
            assert planned[axis] <= measured[axis] <= 1.05 * planned[axis], (axis, measured, planned)
            continue
        assert planned[axis] <= measured[axis] <= planned[axis] + 256, (axis, measured, planned)
    adamw = {"muon_dp2_zero3": ("dp2_zero3", "dp"), "muon_tp2_sequence_parallel": ("tp2_sequence_parallel", "tp")}
    # (ZeRO-1's AdamW layout measures no bytes; the same gather as ZeRO-3's, of the slices: checked against the planner)
    if layout in adamw:
        name, axis = adamw[layout]
        model = Transformer(GPTConfig(**SMALL_GPT))
        matrices = sum(p.numel() for n, p in model.named_parameters() if is_hidden_matrix(n, p.ndim))
        per_block = 2 * 32 * 32 + 2 * 16 * 32 + 3 * 64 * 32  # q, o; k, v (2 KV heads); gate, up, down
        assert matrices == SMALL_GPT["n_layer"] * per_block
        more = measured[axis] - layout_runs[name]["comm_bytes"]["measured"][axis]
        assert more == pytest.approx(matrices * 4 / 2, abs=256), (more, matrices)


def test_the_planner_prices_muons_gathers_and_iteration_in_the_optimizers_step():
    """Llama 3 8B at TP8 x DP2, ZeRO-3: Muon sends every block matrix whole over TP once a step ((tp-1)/tp of its
    fp32 bytes) and its TP part over ZeRO-3's 2 shards (half of that), and the step's optimizer time holds both
    gathers (nothing overlaps them) and the Newton-Schulz products of every matrix, which each rank runs whole."""
    from lit3d.models.optimizer_settings import is_hidden_matrix
    from lit3d.planner import Cluster, Request, plan
    from lit3d.planner.sums import newton_schulz_flops
    from lit3d.planner.tensors import parameter_table

    def chosen(optimizer: str):
        given = dict(tensor_parallel_size=8, pipeline_parallel_size=1, zero_stage=3, global_batch_size=64)
        return plan(Request.given("llama-8b", Cluster(nodes=2), seq_len=2048, optimizer=optimizer, **given)).chosen.plan

    adamw, muon = chosen("adamw"), chosen("muon")
    table = [t for t in parameter_table(GPTConfig.from_name("llama-8b")) if is_hidden_matrix(t.name, len(t.shape))]
    assert all(t.tp_dim is not None for t in table)  # (every one of them split by TP)
    whole = sum(math.prod(t.shape) for t in table)
    sent = {axis: muon.communication_per_step[axis]["bytes"] - adamw.communication_per_step[axis]["bytes"]
            for axis in ("tp", "dp")}  # fmt: skip
    assert sent["tp"] == pytest.approx(7 / 8 * whole * 4, rel=1e-9)
    assert sent["dp"] == pytest.approx(1 / 2 * whole / 8 * 4, rel=1e-9)
    flops = sum(newton_schulz_flops(t) for t in table)
    extra = muon.time_breakdown["optimizer"] - adamw.time_breakdown["optimizer"]
    gathers = sum(muon.communication_per_step[axis]["seconds"] - adamw.communication_per_step[axis]["seconds"]
                  for axis in ("tp", "dp"))  # fmt: skip
    assert extra > gathers + flops / 989e12 > 0  # (at most the H100's dense peak, and the gathers' time besides)


def test_the_planner_spreads_the_iteration_of_matrices_one_group_splits_over_its_ranks():
    """Llama 3 8B at DP8, ZeRO-3 (each matrix sharded over the 8 replicas only): Muon orthogonalises each matrix on one
    replica (`lit3d.models.muon_spread`, in rounds of 8), so a replica sends its shards of the others' matrices and the
    others' shards of its own, about 2 x 7/64 of the matrices' bytes where gathering each whole on every replica would
    send 7/8; and the busiest replica runs the iteration on about 1/8 of them."""
    from lit3d.models.optimizer_settings import is_hidden_matrix
    from lit3d.planner import Cluster, Request, plan
    from lit3d.planner.inputs import Case
    from lit3d.planner.muon import newton_schulz_work, spread_elements
    from lit3d.planner.sums import newton_schulz_flops, rank_sums
    from lit3d.planner.tensors import parameter_table

    def chosen(optimizer: str):
        given = dict(tensor_parallel_size=1, pipeline_parallel_size=1, zero_stage=3, global_batch_size=64)
        return plan(Request.given("llama-8b", Cluster(nodes=1), seq_len=2048, optimizer=optimizer, **given)).chosen

    adamw, candidate = chosen("adamw").plan, chosen("muon")
    config, muon = GPTConfig.from_name("llama-8b"), candidate.plan
    case = Case(config, Cluster(nodes=1), candidate.layout, candidate.training, candidate.parallelism)
    assert (case.layout.dp, case.layout.tp, case.layout.pp) == (8, 1, 1)
    table = [t for t in parameter_table(config) if is_hidden_matrix(t.name, len(t.shape))]
    whole = sum(math.prod(t.shape) for t in table)
    sent = muon.communication_per_step["dp"]["bytes"] - adamw.communication_per_step["dp"]["bytes"]
    assert sent == spread_elements([(t.shape, 0) for t in table], 8) * 4
    assert 14 / 64 * whole * 4 <= sent < 1.05 * 14 / 64 * whole * 4  # (7/8 gathered whole on every replica)
    flops = [newton_schulz_flops(t) for t in table]
    busiest = max(sum(flops[r::8]) for r in range(8))
    assert sum(flops) / 8 <= busiest < 1.05 * sum(flops) / 8
    assert newton_schulz_work(case, rank_sums(case, True, case.chunks)[0]) == pytest.approx(busiest, rel=1e-12)
