"""``lit3d plan`` as a command: its numbers refused by name, its help, the device table, the rank map picture and a
CPU rehearsal planned on a CPU. (tests/test_docs.py runs every plan the docs show and checks the output they quote.)"""

import json

import pytest

from lit3d.cli import main
from lit3d.parallel.layout import Layout
from lit3d.planner import RankMap


@pytest.mark.parametrize(
    "flag, value, named",
    [
        ("--seq_len", "0", "seq_len=0"),
        ("--micro_batch_size", "0", "micro_batch_size=0"),
        ("--gpu_memory", "0", "gpu_memory=0.0"),
        ("--peak_tflops", "0", "peak_tflops=0.0"),
        ("--intra_node_bandwidth", "0", "intra_node_bandwidth=0.0"),
        ("--inter_node_bandwidth", "0", "inter_node_bandwidth=0.0"),
        ("--virtual_pipeline_size", "0", "virtual_pipeline_size=0"),
        ("--inter_island_bandwidth", "0", "inter_island_bandwidth=0.0"),
        ("--inter_island_latency", "-1", "inter_island_latency=-1.0"),
        ("--headroom", "1", "headroom=1.0"),
    ],
)
def test_plan_refuses_zero_and_negative_numbers_naming_the_value(flag, value, named, capsys):
    """``--seq_len 0`` was taken as "not given" and planned the model's default length."""
    with pytest.raises(SystemExit) as error:
        main(["plan", "--model", "tiny", "--gpus_per_node", "2", flag, value])
    message = str(error.value.code)
    assert message.startswith("lit3d plan: error: ") and named in message and "\n" not in message, message
    assert "layout(s) fit" not in capsys.readouterr().out


def test_plan_help_lists_every_preset(capsys):
    from lit3d.models.config import PRESETS

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = "".join(capsys.readouterr().out.split())  # (argparse may wrap a name at its hyphen)
    missing = [name for name in PRESETS if name not in text]
    assert not missing and "mixtral-8x7b" in text, missing


def test_the_gpu_table_knows_blackwell_and_mi300x_with_their_datasheet_numbers():
    """Peaks and links as their datasheets state them; memory as PyTorch reports the card (its "180 GB" are GiB, less
    what the driver keeps: 178.35 GiB of a B200 are 191.5 GB), as a launch plans with it."""
    from lit3d.planner.hardware import GPUS, identify

    assert (GPUS["B200"].peak_tflops, GPUS["B200"].memory_gb, GPUS["B200"].intra_node_gbps) == (2250, 191.5, 900)
    assert (GPUS["GB200"].peak_tflops, GPUS["GB200"].memory_gb, GPUS["GB200"].intra_node_gbps) == (2500, 197.9, 900)
    assert (GPUS["MI300X"].peak_tflops, GPUS["MI300X"].memory_gb, GPUS["MI300X"].memory_bandwidth_gbps) == (
        1307.4,
        206.1,
        5300,
    )
    assert abs(GPUS["H100"].memory_gb * 1e9 / 2**30 - 79.19) < 0.05  # PyTorch: "a total capacity of 79.19 GiB"
    assert all(gpu.memory_bandwidth_gbps > 0 for gpu in GPUS.values())
    names = {
        "NVIDIA B200": "B200",
        "NVIDIA GB200": "GB200",
        "AMD Instinct MI300X": "MI300X",
        "NVIDIA H100 80GB HBM3": "H100",
    }
    assert {device: identify(device).name for device in names} == names


def test_a_search_map_stacks_its_layouts_at_a_readable_width():
    """Three 64-GPU layouts side by side were 3,690 x 960 pixels with 6-point labels: unreadable once shrunk."""
    import matplotlib.pyplot as plt

    from lit3d.planner.rankmap import DPI

    layouts = [Layout(dp=8 // pp, tp=8, pp=pp, devices_per_node=8) for pp in (1, 2, 4)]
    figure = RankMap.side_by_side([RankMap(layout, f"#{i}") for i, layout in enumerate(layouts, 1)]).figure()
    width, height = figure.get_size_inches() * DPI  # the saved .png's pixels
    sizes = [t.get_fontsize() for ax in figure.axes for t in ax.texts]
    plt.close(figure)
    assert width <= 1600 and height > width, (width, height)
    assert min(sizes) >= 8


def test_rank_map_stage_colours_do_not_repeat_up_to_128_stages():
    import matplotlib.pyplot as plt

    figure = RankMap(Layout(dp=1, tp=1, pp=128, devices_per_node=8)).figure()
    colours = [tuple(round(c, 3) for c in patch.get_facecolor()[:3]) for patch in figure.axes[0].patches]
    plt.close(figure)
    assert len(colours) == 128 and len(set(colours)) == 128  # rank r is stage r here
    neighbours = [sum((a - b) ** 2 for a, b in zip(colours[p], colours[p + 1])) ** 0.5 for p in range(127)]
    assert min(neighbours) > 0.25  # adjacent stages stand apart, not just differ


def test_a_cpu_rehearsal_plans_with_its_share_of_this_machines_cpu():
    from lit3d.planner.hardware import GPUS, cpu_share

    share = cpu_share(8, cores=16, memory_gb=32.0)
    assert (share.device, share.memory_gb) == ("CPU process", 4.0)
    assert share.peak_tflops == pytest.approx(2 * GPUS["CPU"].peak_tflops) and share.peak_tflops < 1
    with pytest.raises(ValueError, match="processes=0"):
        cpu_share(0)


def test_every_setting_of_the_strategy_is_a_plan_flag(capsys):
    """The flags come from `Parallelism`'s fields, with their help: a new setting of the strategy is a flag unedited."""
    from dataclasses import fields

    from lit3d.parallel.settings import Parallelism

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f in fields(Parallelism):
        assert f"--{f.name} " in text, f.name
        assert " ".join(f.metadata["help"].split()[:6]) in text, f.name


@pytest.mark.parametrize(
    "flag, value",
    [("--process_group_backend", "gloo"), ("--timeout", "0:20:00"), ("--start_method", "fork"),
     ("--async_checkpoint", "true"), ("--outer_lr", "0.5"), ("--outer_momentum", "0.5")],
)  # fmt: skip
def test_settings_that_do_not_change_the_plan_are_accepted_and_passed_to_the_run(flag, value, capsys):
    args = ["plan", "--model", "tiny", "--gpus_per_node", "2", "--global_batch_size", "8", "--seq_len", "64"]
    main([*args, "--json"])
    plain = json.loads(capsys.readouterr().out)
    main([*args, flag, value, "--json"])
    assert json.loads(capsys.readouterr().out)["step_time_s"] == plain["step_time_s"]
    main([*args, flag, value])
    assert f"--trainer.strategy.{flag[2:]}={value}" in capsys.readouterr().out


def test_search_without_a_config_is_the_search_lit3d_plan_does_anyway(capsys):
    """``--search`` was refused without ``--config`` ("search=True needs --config"), though a plan searches unless
    the layout is given: it plans what the same command without it plans."""
    args = ["plan", "--model", "tiny", "--gpus_per_node", "2", "--global_batch_size", "8", "--seq_len", "64", "--json"]
    main(args)
    searched = json.loads(capsys.readouterr().out)
    main([*args, "--search"])
    assert json.loads(capsys.readouterr().out) == searched and searched["alternatives"]


def test_compile_is_planned_fused_and_passed_to_the_run(capsys):
    args = ["plan", "--model", "tiny", "--gpus_per_node", "2", "--global_batch_size", "8", "--seq_len", "64", "--json"]
    main(args)
    eager = json.loads(capsys.readouterr().out)["time_breakdown"]["memory_bound"]
    main([*args, "--compile", "true"])
    assert json.loads(capsys.readouterr().out)["time_breakdown"]["memory_bound"] < eager
    main([*args[:-1], "--compile", "true"])
    assert "--trainer.strategy.compile=true" in capsys.readouterr().out


@pytest.mark.parametrize(
    "zero_stage, unsharded, ratio", [(0, "false", 1 / 2), (1, "false", 4 / 6), (2, "true", 4 / 6), (2, "false", None),
                                     (3, "false", None)],
)  # fmt: skip
def test_gradients_reduced_in_bf16_send_the_dp_bytes_the_run_sends(zero_stage, unsharded, ratio, capsys):
    """Under bf16-mixed the run reduces gradients in fp32 unless ``mixed_precision_reduce="bfloat16"``: 2 bytes per
    gradient element instead of 4. ZeRO-0 all-reduces gradients only (half the bytes); ZeRO-1 reduce-scatters them
    and all-gathers the bf16 parameters (4 + 2 bytes per element become 2 + 2), as does ZeRO-2 once per step with
    ``accumulate_unsharded``; by default it reduce-scatters at each of the step's micro-steps."""
    args = ["plan", "--model", "llama-8b", "--nodes", "2", "--tensor_parallel_size", "2", "--pipeline_parallel_size",
            "1", "--zero_stage", str(zero_stage), "--seq_len", "4096", "--global_batch_size", "64",
            "--accumulate_unsharded", unsharded, "--json"]  # fmt: skip
    sent = {}
    for dtype in ("float32", "bfloat16"):
        main([*args, "--mixed_precision_reduce", dtype])
        sent[dtype] = json.loads(capsys.readouterr().out)["communication_per_step"]["dp"]["bytes"]
    if ratio is not None:
        assert sent["bfloat16"] == pytest.approx(sent["float32"] * ratio, rel=1e-12)
    else:  # ZeRO-2/3 gather bf16 weights beside the gradient reductions
        assert sent["float32"] > sent["bfloat16"] > sent["float32"] / 2
    main([*args[:-1], "--precision", "32-true", "--mixed_precision_reduce", "bfloat16", "--json"])
    fp32 = json.loads(capsys.readouterr().out)["communication_per_step"]["dp"]["bytes"]
    main([*args[:-1], "--precision", "32-true", "--json"])
    assert fp32 == json.loads(capsys.readouterr().out)["communication_per_step"]["dp"]["bytes"]  # bf16-mixed only


def test_a_search_plans_and_runs_the_reduce_dtype_given(capsys):
    args = ["plan", "--model", "llama-8b", "--nodes", "2", "--seq_len", "4096", "--global_batch_size", "64"]
    main([*args, "--mixed_precision_reduce", "bfloat16"])
    text = capsys.readouterr().out
    assert "--trainer.strategy.mixed_precision_reduce=bfloat16" in text
    main([*args, "--mixed_precision_reduce", "bfloat16", "--top", "1", "--json"])
    halved = json.loads(capsys.readouterr().out)
    main([*args, "--top", "1", "--json"])
    assert halved["step_time_s"] <= json.loads(capsys.readouterr().out)["step_time_s"]


def test_the_planner_is_a_function_from_a_request_to_a_report():
    from lit3d.planner import Cluster, Request, format_report, plan

    request = Request.given("llama-8b", Cluster(nodes=2), seq_len=4096, global_batch_size=64, tensor_parallel_size=2,
                            pipeline_parallel_size=2, mixed_precision_reduce="bfloat16")  # fmt: skip
    report = plan(request)
    chosen = report.chosen
    assert not report.searched and len(report.candidates) == 1
    assert (chosen.layout.dp, chosen.layout.tp, chosen.layout.pp) == (4, 2, 2)
    settings = chosen.parallelism  # what the strategy would be built from: the request's, sized and scheduled
    assert (settings.data_parallel_size, settings.mixed_precision_reduce) == (4, "bfloat16")
    assert settings.sequence_parallel and settings.pipeline_schedule == chosen.plan.pipeline_schedule
    assert report.to_dict()["layout"]["pipeline_parallel_size"] == 2
    assert "gradients reduced in bfloat16" in format_report(report)
    searched = plan(Request.given("llama-8b", Cluster(nodes=2), seq_len=4096, global_batch_size=64, zero_stage=2))
    assert searched.searched and {c.parallelism.zero_stage for c in searched.candidates} == {2}
    assert all(c.parallelism.tensor_parallel_size == c.layout.tp for c in searched.candidates)


def test_lora_and_offload_are_planned_from_the_command_line(capsys):
    """``--lora_rank``: the frozen weights hold no gradients or optimizer states; ``--offload``: the states move to
    the host (ZeRO-3 unless given); both are passed to the run."""
    args = ["plan", "--model", "llama-8b", "--gpus_per_node", "8", "--tensor_parallel_size", "1",
            "--pipeline_parallel_size", "1", "--global_batch_size", "64", "--seq_len", "4096"]  # fmt: skip
    main([*args, "--json"])
    full = json.loads(capsys.readouterr().out)["memory_per_gpu"]
    main([*args, "--lora_rank", "16", "--json"])
    lora = json.loads(capsys.readouterr().out)["memory_per_gpu"]
    assert lora["grads"] < full["grads"] / 500 and lora["optimizer"] < full["optimizer"] / 500
    main([*args, "--offload", "--json"])
    offloaded = json.loads(capsys.readouterr().out)
    assert offloaded["layout"]["zero_stage"] == 3 and offloaded["memory_per_gpu"]["optimizer"] == 0
    assert offloaded["memory_per_gpu"]["host"] > full["params"]
    assert offloaded["time_breakdown"]["exposed_communication"]["host"] > 0
    main([*args, "--lora_rank", "16", "--lora_targets", "[q,k,v,o,gate,up,down]", "--offload"])
    text = capsys.readouterr().out
    assert "LoRA rank 16 on q, k, v, o, gate, up, down" in text and "host memory" in text
    main([*args[:5], *args[9:], "--lora_rank", "16", "--offload"])  # a search: the command that runs the best
    assert "--trainer.strategy.offload=true --model.lora.rank=16 --model.lora.targets=[q,v]" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"lora.targets=\['q', 'x'\]: \['x'\] not among"):
        main([*args, "--lora_rank", "16", "--lora_targets", "[q,x]"])
    with pytest.raises(SystemExit, match=r"lora_targets=\['q'\] needs lora_rank"):
        main([*args, "--lora_targets", "[q]"])


def test_headroom_is_the_share_of_the_card_a_layout_leaves_free(capsys):
    """``--headroom``: a layout planned at 95 % of the card does not fit with the default 10 % kept free, and fits
    with 2 %."""
    args = ["plan", "--model", "llama-8b", "--tensor_parallel_size", "1", "--pipeline_parallel_size", "1",
            "--global_batch_size", "64", "--seq_len", "4096"]  # fmt: skip
    main([*args, "--json"])
    peak = json.loads(capsys.readouterr().out)["memory_per_gpu"]["total"]
    card = ["--gpu_memory", str(peak / 0.95 / 1e9)]
    main([*args, *card])
    assert "less 10% headroom): DOES NOT FIT" in capsys.readouterr().out
    main([*args, *card, "--headroom", "0.02"])
    assert "less 2% headroom): fits" in capsys.readouterr().out


def test_packed_documents_count_only_the_attention_within_each(capsys):
    """``--document_length``: the model FLOPs (and the MFU) drop by the attention across documents; the step is
    priced as the masked kernel runs it, whole."""
    args = ["plan", "--model", "llama-8b", "--tensor_parallel_size", "1", "--pipeline_parallel_size", "1",
            "--global_batch_size", "64", "--seq_len", "8192", "--json"]  # fmt: skip
    main(args)
    whole = json.loads(capsys.readouterr().out)
    main([*args, "--document_length", "1024"])
    packed = json.loads(capsys.readouterr().out)
    from lit3d.models.config import GPTConfig

    config = GPTConfig.from_name("llama-8b")
    dropped = (config.attention_flops_per_token(8192) - config.attention_flops_per_token(1024)) * 64 * 8192
    assert whole["flops_per_step"] - packed["flops_per_step"] == pytest.approx(dropped)
    assert packed["step_time_s"] == whole["step_time_s"] and packed["mfu"] < whole["mfu"]
    with pytest.raises(SystemExit, match="document_length=0"):
        main([*args, "--document_length", "0"])
