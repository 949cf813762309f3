"""FP8 training (``Parallel3DStrategy(float8=...)``, torchao's float8 on the blocks' linears): every layout follows
the single-process FP8 run, FP8 all-gather halves the linears' gather bytes as the planner counts them, checkpoints
stay in high precision, and what cannot run in FP8 is refused by name before any process starts."""

import pytest
import torch
from float8_layouts import FLOAT8_LAYOUTS, FP8_GPT, FP8_SAVED, FP8_STEPS

from lit3d import GPTConfig
from lit3d.parallel.precision import check_float8
from lit3d.parallel.settings import Parallelism
from lit3d.strategies.torch_compat import rowwise_float8_on_cpu

FP8_RUNS = [name for name in FLOAT8_LAYOUTS if name.startswith("fp8_")]


def relative(losses, reference):
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


@pytest.mark.parametrize("layout", FP8_RUNS)
def test_each_layout_follows_the_single_process_fp8_run(layout, layout_runs, float8_references):
    """Within 1e-2 relative over every step (FP8's dynamic scales follow each layout's rounding), every rank's block
    linears in FP8: 7 per block it holds."""
    run = layout_runs[layout]
    reference = float8_references["rowwise" if "rowwise" in layout else "tensorwise"]["losses"]
    assert len(run["losses"]) == len(reference) == FP8_STEPS and reference[-1] < reference[0] - 0.5  # (0.69 measured)
    assert relative(run["losses"], reference) <= 1e-2
    blocks = FP8_GPT["n_layer"] // (2 if "pp2" in layout else 1)
    assert [rank["float8_linears"] for rank in run["ranks"]] == [7 * blocks] * len(run["ranks"])


def test_fp8_all_gather_halves_the_linears_gather_bytes_as_the_planner_counts(layout_runs):
    """ZeRO-3 gathers each block's weights twice per step (forward, backward): the linears' in one byte instead of
    bf16's two, and their scales' amaxes in one fp32 all-reduce after each step. Measured = planned within 256 B."""
    fp8, bf16 = (layout_runs[name]["comm_bytes"] for name in ("fp8_dp2_zero3_all_gather", "bf16_dp2_zero3"))
    for comm in (fp8, bf16):
        assert comm["planned"]["dp"] <= comm["measured"]["dp"] <= comm["planned"]["dp"] + 256, comm
    config = GPTConfig(**FP8_GPT)
    linears = config.n_layer * config.d_model * (2 * config.n_head * config.head_dim + 2 * config.n_kv_head *
                                                 config.head_dim + 3 * config.d_ff)  # fmt: skip
    scales = 2 * (1 / 2) * 4 * 7 * config.n_layer  # one fp32 amax per linear, all-reduced over 2 ranks
    assert bf16["measured"]["dp"] - fp8["measured"]["dp"] == 2 * (1 / 2) * linears * (2 - 1) - scales


def test_a_checkpoint_saved_in_fp8_at_tp2_resumes_in_bf16_on_one_process(float8_references):
    """The weights and optimizer states stay in high precision with layout-free names: a bf16 run picks up where
    the FP8 one stopped and follows the FP8 curve within 1e-2."""
    resumed, reference = float8_references["resumed_in_bf16"]["losses"], float8_references["tensorwise"]["losses"]
    assert len(resumed) == FP8_STEPS - FP8_SAVED
    assert relative(resumed, reference[FP8_SAVED:]) <= 1e-2


def test_an_fp8_all_gather_checkpoint_exports_in_a_process_without_torchao(layout_runs, tmp_path):
    """The checkpoint holds plain tensors (not torchao's wrappers of FP8 all-gather's weights): `lit3d export` reads
    it without importing torchao."""
    import os
    import sys

    import forked

    saved = layout_runs["fp8_dp2_zero3_all_gather"]["job_dir"] + f"/ckpts/step={FP8_SAVED}.ckpt"
    code = ("import sys; from lit3d.cli import main; main(['export', '--ckpt_path', sys.argv[1], '--output', "
            "sys.argv[2]]); assert 'torchao' not in sys.modules, 'torchao was imported'")  # fmt: skip
    # (forked: torchao is not among what the fork server has imported, `forked.PRELOAD`)
    run = forked.run([sys.executable, "-c", code, saved, str(tmp_path / "hf")], cwd=tmp_path, env=dict(os.environ))
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_the_blocks_linears_run_in_fp8_and_the_embedding_head_router_and_experts_stay_in_bf16():
    from torchao.float8.float8_linear import Float8Linear

    from lit3d.models.transformer import Transformer
    from lit3d.strategies.split.float8 import apply_float8

    config = GPTConfig(
        **{**FP8_GPT, "n_layer": 4}, n_expert=4, n_expert_per_token=2, d_ff_expert=64, first_dense_layers=1
    )
    network = Transformer(config)
    assert apply_float8(network, "rowwise") == 4 * 4 + 3  # q, k, v, o per block; gate, up, down of the dense one
    fp8 = {name for name, m in network.named_modules() if isinstance(m, Float8Linear)}
    assert "blocks.0.mlp.down_proj" in fp8 and "blocks.3.attn.k_proj" in fp8
    assert not {"embed", "head", "blocks.1.mlp.router.gate"} & fp8 and "blocks.1.mlp.experts" not in fp8
    assert "blocks.0.attn.q_proj.weight" in dict(network.named_parameters())  # the names checkpoints use


def linear_step(recipe: str, emulate: bool) -> tuple[list[torch.Tensor], int]:
    """One forward and backward of a small FP8 model's ``mlp.up_proj`` under bf16 autocast, on fixed inputs: its
    output, input gradient and weight gradient, and how many ``torch._scaled_mm`` calls it made."""
    from torch.profiler import profile

    from lit3d.models.transformer import Transformer
    from lit3d.strategies.split.float8 import apply_float8

    network = Transformer(GPTConfig(**FP8_GPT))
    network.reset_parameters(seed=0)
    apply_float8(network, recipe, emulate=emulate)
    linear = network.blocks["0"].mlp.up_proj
    x = torch.randn(64, FP8_GPT["d_model"], generator=torch.Generator().manual_seed(1)).requires_grad_()
    with profile() as profiled:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = linear(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(y.dtype))
    calls = sum(event.name == "aten::_scaled_mm" for event in profiled.events())
    return [y.float().detach(), x.grad, linear.weight.grad], calls


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_on_cpu_fp8_matmuls_are_emulated_and_pytorchs_scaled_mm_still_computes_the_same(recipe):
    """The CPU default (torchao's emulation) calls no ``_scaled_mm``; PyTorch's CPU kernel, chosen, runs the 3 matmuls
    of a step (output, input and weight gradients) on the same FP8 operands: the same numbers within 1e-2 of the
    largest (measured on AVX2: rowwise the same bits, tensorwise 6.8e-4 where dividing by a scale rounds otherwise)."""
    if recipe == "rowwise" and not rowwise_float8_on_cpu():
        pytest.skip(f"PyTorch {torch.__version__}'s CPU FP8 matmul takes one scale per tensor")
    emulated, calls = linear_step(recipe, emulate=True)
    assert calls == 0
    kernel, calls = linear_step(recipe, emulate=False)
    assert calls == 3
    for a, b in zip(emulated, kernel):
        assert (a - b).abs().max() <= 1e-2 * b.abs().max()


def test_the_cpu_matmul_path_is_chosen_by_its_variable_logged_and_refused_by_name(monkeypatch):
    """``LIT3D_FLOAT8_CPU_MATMUL``: unset, torchao's emulation; ``scaled_mm``, PyTorch's kernel (and row-wise scales
    refused where that kernel lacks them); another value refused naming it. Accelerators always run the kernel."""
    from types import SimpleNamespace

    from lightning.pytorch.accelerators import CPUAccelerator

    from lit3d.parallel.layout import Layout
    from lit3d.strategies import checks
    from lit3d.strategies.split.float8 import CPU_MATMUL, cpu_matmul_line, emulates

    def check(recipe: str = "rowwise") -> None:
        trainer, layout = SimpleNamespace(accelerator=CPUAccelerator(), precision="bf16-mixed"), Layout(1, 1, 1, 1)
        checks._check_float8(Parallelism(float8=recipe), layout, None, trainer, None)

    monkeypatch.delenv(CPU_MATMUL, raising=False)
    monkeypatch.setattr(checks, "rowwise_float8_on_cpu", lambda: False)  # as PyTorch 2.11 and 2.12
    assert emulates("cpu") and not emulates("cuda")
    assert cpu_matmul_line("rowwise").startswith("float8='rowwise' on CPU: FP8 casts and scales as on a GPU, matmuls "
                                                 "emulated in fp32")  # fmt: skip
    check()
    monkeypatch.setenv(CPU_MATMUL, "scaled_mm")
    assert not emulates("cpu") and "matmuls in PyTorch's CPU _scaled_mm" in cpu_matmul_line("rowwise")
    check("tensorwise")
    with pytest.raises(ValueError, match=r"float8='rowwise' on CPU with PyTorch .* and LIT3D_FLOAT8_CPU_MATMUL="):
        check()
    monkeypatch.setenv(CPU_MATMUL, "fast")
    with pytest.raises(ValueError, match="LIT3D_FLOAT8_CPU_MATMUL='fast' is not one of 'emulated', 'scaled_mm'"):
        check("tensorwise")


@pytest.mark.parametrize(
    "settings, message",
    [(dict(float8="fp4"), "float8='fp4' is not one of None, 'tensorwise', 'rowwise'"),
     (dict(float8="rowwise", float8_all_gather=True, zero_stage=3), "float8_all_gather=True with float8='rowwise'"),
     (dict(float8="tensorwise", float8_all_gather=True, zero_stage=1), "float8_all_gather=True with zero_stage=1")],
)  # fmt: skip
def test_bad_fp8_settings_are_refused_naming_the_values(settings, message):
    with pytest.raises(ValueError, match=message):
        Parallelism(**settings)


def test_fp8_is_refused_in_fp32_and_for_widths_fp8_matmuls_cannot_take():
    with pytest.raises(ValueError, match=r"float8='rowwise' with precision='32-true': FP8 matmuls run inside a bf16"):
        check_float8("rowwise", "32-true")
    with pytest.raises(
        ValueError,
        match=r"\{'n_kv_head x head_dim': 32\} not multiples of 16 \(those TP splits: of 16 x tensor_parallel_size=4\)",
    ):
        check_float8("tensorwise", "bf16-mixed", GPTConfig(**FP8_GPT), tp=4)
    check_float8("tensorwise", "bf16-mixed", GPTConfig(**FP8_GPT), tp=2)  # 16 per rank: fine
    with pytest.raises(ValueError, match="float8='rowwise' with LoRA adapters: train the adapters in bf16"):
        check_float8("rowwise", "bf16-mixed", GPTConfig(**FP8_GPT), lora=True)


def test_fp8_on_linears_too_small_for_it_is_said_before_the_run_naming_the_width():
    """A 4-block d_model=128 model ended 3.8 % above bf16-mixed in tensorwise FP8: the check before any rank starts
    warns, naming the width and each linear's GEMM per rank under torchao's sizes (measured on H100); a model whose
    linears are all large enough hears nothing, and one with a few small ones hears which."""
    import warnings
    from types import SimpleNamespace

    from lit3d.parallel.layout import Layout
    from lit3d.strategies.checks import check_run

    def warnings_of(recipe: str, config: GPTConfig, tp: int = 1) -> list[str]:
        module, layout = SimpleNamespace(config=config), Layout(dp=1, tp=tp, pp=1, devices_per_node=tp)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_run(Parallelism(float8=recipe, tensor_parallel_size=tp), layout, module, None, None)
        return [str(w.message) for w in caught if "float8=" in str(w.message)]

    small = GPTConfig(n_layer=4, n_head=4, n_kv_head=2, d_model=128, d_ff=352, vocab_size=256)
    (said,) = warnings_of("tensorwise", small)
    assert said.startswith("float8='tensorwise' with d_model=128: every linear FP8 runs is too small for it to pay")
    assert "attn.q_proj 128x128, attn.k_proj 128x64" in said and "mlp.down_proj 352x128 (in x out)" in said
    assert "3.8% above bf16-mixed" in said and "in bf16-mixed" in said
    assert warnings_of("tensorwise", GPTConfig.from_name("llama-70b"), tp=8) == []
    (said,) = warnings_of("rowwise", GPTConfig.from_name("llama-70b"), tp=8)
    assert said.startswith("float8='rowwise' with d_model=8192: attn.q_proj 8192x1024, attn.k_proj 8192x128")
    assert "(in x out per rank at tensor_parallel_size=8)" in said and "every linear" not in said


def test_the_command_line_refuses_fp8_in_fp32_before_any_process_starts():
    from lit3d.cli import main

    args = ["fit", "--model.config=tiny", "--trainer.max_steps=1", "--trainer.devices=2", "--trainer.accelerator=cpu",
            "--trainer.strategy=Parallel3DStrategy", "--trainer.strategy.float8=tensorwise"]  # fmt: skip
    with pytest.raises(SystemExit) as error:
        main(args)
    message = str(error.value.code)
    assert "float8='tensorwise' with precision='32-true'" in message, message


@pytest.mark.gpu
def test_fp8_on_the_gpu_runs_the_fast_kernels_and_follows_bf16():
    """On CUDA (H100 and later), the same layer runs torch._scaled_mm's FP8 kernels; its loss follows bf16's."""
    from lit3d.models.transformer import Transformer
    from lit3d.strategies.split.float8 import apply_float8

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need compute capability 8.9 or later")
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=8, n_kv_head=8, d_model=512, d_ff=1536, vocab_size=1024, max_seq_len=256)
    plain = Transformer(config).cuda()
    plain.reset_parameters(seed=0)
    fp8 = Transformer(config).cuda()
    fp8.load_state_dict(plain.state_dict())
    apply_float8(fp8, "tensorwise")
    tokens = torch.randint(0, 1024, (4, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = plain(tokens).float(), fp8(tokens).float()
    assert (a - b).abs().mean() / a.abs().mean() < 0.05


def test_the_planner_runs_the_blocks_gemms_at_the_fp8_peak_and_refuses_gpus_without_fp8():
    """On an H100 (FP8 twice bf16's peak) the blocks' matmuls take less time, the head's and attention's the same;
    an A100 has no FP8 tensor cores."""
    from lit3d.planner import Cluster, Request, plan
    from lit3d.planner.hardware import GPUS

    def compute(gpu: str, **fp8) -> float:
        cluster = Cluster.of(GPUS[gpu], nodes=1, gpus_per_node=8)
        request = Request.given("llama3.1-8b", cluster, seq_len=4096, global_batch_size=8, tensor_parallel_size=1,
                                pipeline_parallel_size=1, zero_stage=3, micro_batch_size=1, **fp8)  # fmt: skip
        return plan(request).chosen.plan.time_breakdown["compute"]

    bf16, fp8 = compute("H100"), compute("H100", float8="rowwise")
    assert 0.5 * bf16 < fp8 < 0.8 * bf16  # the blocks' GEMMs (most of the FLOPs) twice as fast, the rest as it was
    with pytest.raises(ValueError, match="float8='rowwise' on A100: it has no FP8 tensor cores"):
        compute("A100", float8="rowwise")
