"""The planner: known answers from the literature, exact agreement with the real parallelisation and with the
bytes a run holds, the search, the rank map, the CLI and its errors."""

import json

import pytest

from lit3d.cli import main
from lit3d.models.config import GPTConfig
from lit3d.parallel.layout import Layout
from lit3d.parallel.settings import Parallelism
from lit3d.planner import GB, Cluster, RankMap, Training, estimate, layout_problem, search, verify
from lit3d.planner.hsdp import ranking_times

GPT3 = GPTConfig.from_name("gpt3-175b")
MEGATRON_GPT3 = Layout(dp=8, tp=8, pp=16, devices_per_node=8)  # 1,024 GPUs on 128 nodes


def gpt3_plan(zero_stage):
    return estimate(
        GPT3,
        Cluster(nodes=128),
        MEGATRON_GPT3,
        Training(seq_len=2048, global_batch_size=1536),
        Parallelism(zero_stage=zero_stage),
    )


def test_gpt3_state_per_gpu_is_the_known_answer():
    plan = gpt3_plan(zero_stage=0)
    # A stage of 6 of the 96 blocks split 8 ways holds 21.8 GB of state, 16 bytes per parameter (Megatron's 2 + 2 + 12
    # of bf16 weights and gradients, fp32 master weights and two moments). Data parallelism over TP and PP is FSDP2's
    # replicate, which holds them as lit3d runs them: 5.4 GB of fp32 weights (the master weights, cast to bf16 for
    # compute), 5.4 of fp32 gradients, 10.9 of moments. The end stages also hold the embedding or head.
    middle = plan.memory_by_stage[1]
    assert middle["params"] / GB == pytest.approx(5.45, rel=0.01)
    assert middle["grads"] / GB == pytest.approx(5.45, rel=0.01)
    assert middle["optimizer"] / GB == pytest.approx(10.9, rel=0.01)
    assert sum(middle[k] for k in ("params", "grads", "optimizer")) / GB == pytest.approx(21.8, rel=0.01)
    most = plan.memory_per_gpu
    assert sum(most[k] for k in ("params", "grads", "optimizer")) / GB == pytest.approx(21.8, rel=0.07)
    assert most["total"] == max(stage["total"] for stage in plan.memory_by_stage)


def test_zero1_keeps_bf16_weights_and_slices_master_weights_moments_and_kept_gradients_over_data_parallel():
    z0, z1 = gpt3_plan(0).memory_per_gpu, gpt3_plan(1).memory_per_gpu
    # ZeRO-1 under bf16-mixed is Megatron's distributed optimizer: bf16 parameters (half of ZeRO-0's fp32 ones), and
    # of a 1/8 slice the fp32 gradient and the fp32 master weights with both moments: 2 + (4 + 12) / 8 bytes.
    assert z1["params"] == z0["params"] / 2
    assert z1["grads"] == z0["grads"] / 8  # the reduce-scattered slice only
    assert z1["optimizer"] == pytest.approx(z0["optimizer"] * 12 / 8 / 8, rel=1e-4)  # but for the step counters


def test_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    plan = estimate(
        GPTConfig.from_name("llama-8b"),
        Cluster(nodes=4),
        Layout(dp=2, tp=4, pp=4, devices_per_node=8),
        Training(global_batch_size=32),
        Parallelism(pipeline_schedule="1f1b"),
    )
    assert plan.num_microbatches == 16
    assert plan.pipeline_bubble == pytest.approx(3 / 19)


def test_llama_405b_fits_on_16384_h100s_and_70b_does_not_fit_on_one():
    llama405 = GPTConfig.from_name("llama-405b")
    plan = estimate(
        llama405,
        Cluster(nodes=2048),
        Layout(dp=128, tp=8, pp=16, devices_per_node=8),
        Training(seq_len=8192, micro_batch_size=1, global_batch_size=2048),
        Parallelism(zero_stage=1, sequence_parallel=True, activation_checkpointing=True),
    )
    assert plan.fits and plan.memory_per_gpu["total"] < 80 * GB
    without_checkpointing = estimate(
        llama405,
        Cluster(nodes=2048),
        Layout(dp=128, tp=8, pp=16, devices_per_node=8),
        Training(seq_len=8192, global_batch_size=2048),
        Parallelism(zero_stage=1, sequence_parallel=True),
    )
    assert not without_checkpointing.fits
    llama70 = GPTConfig.from_name("llama-70b")
    one_gpu = Cluster(nodes=1, gpus_per_node=1)
    for zero in range(4):
        plan = estimate(
            llama70,
            one_gpu,
            Layout(1, 1, 1, 1),
            Training(seq_len=1024, global_batch_size=1),
            Parallelism(zero_stage=zero, activation_checkpointing=True),
        )
        assert not plan.fits and plan.memory_per_gpu["params"] > 80 * GB
    fitting, _ = search(llama70, one_gpu, Training(seq_len=1024, global_batch_size=1))
    assert fitting == []


@pytest.mark.parametrize(
    "name, layout, zero_stage, virtual, schedule",
    [
        ("tiny", Layout(dp=2, tp=2, pp=2, devices_per_node=4), 3, 1, "1f1b"),
        ("tiny", Layout(dp=2, tp=1, pp=2, devices_per_node=4), 1, 2, "interleaved_1f1b"),
        ("tiny", Layout(dp=2, tp=2, pp=2, devices_per_node=4), 2, 2, "zbv"),  # rank 0: the first and last stages
        ("gpt3-175b", MEGATRON_GPT3, 0, 1, "1f1b"),  # 1,024 simulated ranks
        ("llama-8b", Layout(dp=32, tp=8, pp=4, devices_per_node=8), 2, 1, "1f1b"),
        ("moonlight-16b-a3b", Layout(dp=2, tp=2, pp=2, devices_per_node=8, ep=2), 1, 1, "1f1b"),  # MLA, DeepSeekMoE
    ],
)
def test_verify_counts_match_the_analytic_ones_exactly(name, layout, zero_stage, virtual, schedule):
    import time

    from lit3d.strategies.split.count import held_params

    start = time.perf_counter()
    settings = Parallelism(zero_stage=zero_stage, virtual_pipeline_size=virtual, pipeline_schedule=schedule).at(layout)
    counts = verify(GPTConfig.from_name(name), layout, settings, held_params)
    assert len(counts) == layout.pp
    assert [c.verified for c in counts] == [c.analytic for c in counts]
    assert all(c.verified > 0 for c in counts)
    assert time.perf_counter() - start < 60  # seconds, not minutes, for 1,024 ranks


def test_the_estimate_of_a_pipeline_with_accumulation_has_micro_batches_of_the_right_size(layout_runs):
    """Global batch 8 on pp2 in 4 micro-batches: accumulating 2 halves each micro-batch, so the activations held."""
    for rank in (0, 1):
        plain = layout_runs["pp2_1f1b"]["ranks"][rank]["memory"]["estimate"]
        accumulating = layout_runs["pp2_1f1b_accumulate2"]["ranks"][rank]["memory"]["estimate"]
        assert accumulating["activations"] * 2 == pytest.approx(plain["activations"], rel=1e-6), rank


def test_fit_logs_the_planner_estimate_and_it_equals_the_measured_bytes(layout_runs):
    """In every layout of the suite (ZeRO 0-3, TP, SP, PP, DP x TP x PP, mixed precision, LoRA with its frozen
    weights, offload, chat data), each rank's parameters, gradients and optimizer state are what the planner said
    before the run (offloaded: all of them in host memory)."""
    checked = 0
    for name, run in layout_runs.items():
        for rank, report in enumerate(run["ranks"]):
            memory = report["memory"]
            if not memory:
                continue
            estimate_ = memory["estimate"]
            assert estimate_ is not None, name
            if "host" in estimate_:
                assert memory["params"] + memory["grads"] + memory["optimizer"] == estimate_["host"], name
            else:
                for key in ("params", "grads", "optimizer"):
                    assert memory[key] == estimate_[key], f"{name} rank {rank}: {key}"
            checked += 1
    assert checked >= 40


def test_search_keeps_valid_layouts_that_fit_fastest_first():
    config, cluster = GPTConfig.from_name("llama-70b"), Cluster(nodes=8)
    training = Training(seq_len=4096, global_batch_size=512)
    fitting, dropped = search(config, cluster, training)
    assert fitting and dropped["out_of_memory"] > 0
    ranked = ranking_times(fitting)  # (HSDP's groups that save too little rank as their one-group run)
    times = [round(ranked[id(c)], 6) for c in fitting]  # equal to the microsecond: the least DP traffic first
    assert times == sorted(times)
    for c in fitting:
        assert c.plan.fits and c.layout.world_size == cluster.gpus
        assert cluster.gpus_per_node % c.layout.tp == 0 and config.n_kv_head % c.layout.tp == 0
        assert layout_problem(config, cluster, c.layout, c.training, c.parallelism) is None
        assert (c.parallelism.tensor_parallel_size, c.parallelism.pipeline_parallel_size) == (c.layout.tp, c.layout.pp)
    # Sizes given are kept.
    fixed, _ = search(config, cluster, training, tensor_parallel_size=8)
    assert fixed and {c.layout.tp for c in fixed} == {8}


def test_layout_problems_name_the_values():
    config, cluster = GPTConfig.from_name("llama-8b"), Cluster(nodes=1)
    training = Training(global_batch_size=64)
    assert "n_kv_head=8" in layout_problem(
        config, cluster, Layout(1, 16, 1, 16), training
    ) or "16 GPUs" in layout_problem(config, cluster, Layout(1, 16, 1, 16), training)
    assert "tensor_parallel_size=3" in layout_problem(config, Cluster(nodes=3), Layout(8, 3, 1, 8), training)
    assert "n_layer=32" in layout_problem(config, Cluster(nodes=8), Layout(1, 1, 64, 8), training)
    assert "global_batch_size=64" in layout_problem(config, Cluster(nodes=12), Layout(96, 1, 1, 8), training)


def test_rank_map_draws_the_fleet(tmp_path):
    small = RankMap(Layout(dp=2, tp=2, pp=2, devices_per_node=4))
    assert small.nodes_drawn() == ([0, 1], False)
    big = RankMap(Layout(dp=8, tp=8, pp=16, devices_per_node=8))
    nodes, one_replica = big.nodes_drawn()
    assert one_replica and nodes == [8 * p for p in range(16)]  # replica 0: one node per stage
    assert big._repr_svg_().lstrip().startswith("<?xml") and "<svg" in big._repr_svg_()
    assert (small.save(tmp_path / "map.png").read_bytes()[:8]) == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in small.save(tmp_path / "map.html").read_text()
    with pytest.raises(ValueError, match="map.pdf"):
        small.save(tmp_path / "map.pdf")


def test_a_search_map_draws_the_best_three_layouts_with_ranks_memory_and_traffic(tmp_path, capsys):
    import matplotlib.pyplot as plt

    config, cluster = GPTConfig.from_name("llama-70b"), Cluster(nodes=8)
    fitting, _ = search(config, cluster, Training(seq_len=4096, global_batch_size=512))
    maps = [RankMap(c.layout, f"#{i}", c.plan) for i, c in enumerate(fitting[:3], 1)]
    figure = RankMap.side_by_side(maps).figure()
    assert len(figure.axes) == 3
    texts = [t.get_text() for ax in figure.axes for t in ax.texts]
    titles = [ax.get_title() for ax in figure.axes]
    plt.close(figure)
    best = fitting[0]
    assert f"r{best.layout.world_size - 1}\n" in "".join(texts)  # every rank by its global number
    assert any(f"{best.plan.memory_by_stage[0]['total'] / 1e9:.2f} GB" in t for t in texts)  # its memory
    assert "on 450 GB/s" in titles[0] and "per GPU at most" in titles[0]  # traffic per link, memory, step time
    main(["plan", "--model", "llama-70b", "--nodes", "8", "--seq_len", "4096", "--global_batch_size", "512",
          "--map", str(tmp_path / "best.png")])  # fmt: skip
    assert (tmp_path / "best.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_plan_json_verify_and_map(tmp_path, capsys):
    main(
        [
            "plan",
            "--model",
            "gpt3-175b",
            "--nodes",
            "128",
            "--tensor_parallel_size",
            "8",
            "--pipeline_parallel_size",
            "16",
            "--zero_stage",
            "1",
            "--pipeline_schedule",
            "1f1b",
            "--global_batch_size",
            "1536",
            "--seq_len",
            "2048",
            "--json",
            "--map",
            str(tmp_path / "fleet.svg"),
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert report["layout"] == {
        "data_parallel_size": 8,
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 16,
        "zero_stage": 1,
        "virtual_pipeline_size": 1,
        "expert_parallel_size": 1,
        "context_parallel_size": 1,
    }
    assert set(report["memory_per_gpu"]) >= {"params", "grads", "optimizer", "activations", "total"}
    assert set(report["communication_per_step"]) == {"tp", "pp", "dp", "ep", "cp"}
    assert report["communication_per_step"]["ep"]["bytes"] == 0  # a dense model
    assert report["pipeline_bubble"] == pytest.approx(
        15 / (192 + 15)
    )  # m = 1536 / 8 replicas and report["step_time_s"] > 0
    assert "<svg" in (tmp_path / "fleet.svg").read_text()

    main(
        [
            "plan",
            "--model",
            "tiny",
            "--nodes",
            "2",
            "--gpus_per_node",
            "4",
            "--global_batch_size",
            "16",
            "--seq_len",
            "128",
            "--verify",
        ]
    )
    out = capsys.readouterr().out
    assert "layout(s) fit" in out and "why:" in out and "match" in out and "MISMATCH" not in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "gpt-9"], "unknown model preset 'gpt-9'"),
        (["--nodes", "0"], "nodes=0"),
        (["--gpu_memory", "-80"], "gpu_memory=-80"),
        (["--seq_len", "99999"], "seq_len=99999"),
        (
            ["--model", "llama-8b", "--tensor_parallel_size", "16", "--pipeline_parallel_size", "1", "--nodes", "2"],
            "tensor_parallel_size=16 does not divide n_kv_head=8",
        ),
        (["--tensor_parallel_size", "8", "--pipeline_parallel_size", "2", "--data_parallel_size", "4"], "64 GPUs"),
        (["--zero_stage", "5"], "zero_stage=5"),
        (["--precision", "fp8"], "precision='fp8'"),
    ],
)
def test_cli_plan_refuses_bad_input_naming_the_value(args, message):
    with pytest.raises(SystemExit) as error:
        main(["plan", *args])
    assert message in str(error.value)


@pytest.mark.parametrize("name", ["125m", "1b", "llama-8b", "llama-70b", "llama-405b", "gpt3-175b"])
def test_each_preset_config_parses_and_its_layout_fits_in_80_gb(name):
    from pathlib import Path

    import yaml

    path = Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml"
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(path), "--print_config"])
    assert done.value.code in (0, None)
    spec = yaml.safe_load(path.read_text())
    trainer, strategy, data = spec["trainer"], spec["trainer"]["strategy"]["init_args"], spec["data"]["init_args"]
    tp, pp = strategy.get("tensor_parallel_size", 1), strategy.get("pipeline_parallel_size", 1)
    layout = Layout(
        dp=trainer["num_nodes"] * trainer["devices"] // (tp * pp), tp=tp, pp=pp, devices_per_node=trainer["devices"]
    )
    steps = strategy.get("num_microbatches", 1) * trainer.get("accumulate_grad_batches", 1)
    training = Training(
        seq_len=data["seq_len"],
        global_batch_size=data["global_batch_size"],
        micro_batch_size=data["global_batch_size"] // (layout.dp * steps),
    )
    settings = Parallelism(**strategy)  # the run's settings, as the strategy is built from them
    cluster = Cluster(nodes=trainer["num_nodes"], gpus_per_node=trainer["devices"])
    config = GPTConfig.from_name(name)
    assert layout_problem(config, cluster, layout, training, settings) is None
    assert estimate(config, cluster, layout, training, settings).fits


def test_the_rank0_log_says_what_dtype_each_axis_communicates_in():
    from lit3d.parallel.zero import ZeroPolicy
    from lit3d.strategies.optim.dtypes import describe_dtypes

    assert "every axis communicates in fp32" in describe_dtypes("32-true", ZeroPolicy(1, 2), False, "float32")
    line = describe_dtypes("bf16-mixed", ZeroPolicy(3, 2), False, "float32")
    assert "parameters gathered in bf16" in line and "gradients reduced in fp32" in line
    zero1 = describe_dtypes("bf16-mixed", ZeroPolicy(1, 2), False, "bfloat16")
    assert "reduce-scattered in bf16" in zero1 and "bf16 parameters, fp32 master weights" in zero1
    assert "all-reduced in fp32 (DDP)" in describe_dtypes("bf16-mixed", ZeroPolicy(0, 2), True, "float32")
    # ZeRO-1 without data-parallel replicas (TP only) has nothing to shard: it keeps fp32 parameters
    assert "precision bf16-mixed: fp32 parameters, " in describe_dtypes(
        "bf16-mixed", ZeroPolicy(1, 1), False, "float32"
    )


def test_plan_json_reports_flops_parameters_and_activations_per_layer(capsys):
    from lit3d.cli import main

    args = ["plan", "--model", "llama-8b", "--tensor_parallel_size", "2", "--pipeline_parallel_size", "2",
            "--seq_len", "4096", "--global_batch_size", "64", "--json"]  # fmt: skip
    reports = {}
    for checkpointing in ("false", "selective", "full"):
        main([*args, "--activation_checkpointing", checkpointing])
        reports[checkpointing] = json.loads(capsys.readouterr().out)
    config, report = GPTConfig.from_name("llama-8b"), reports["false"]
    assert report["flops_per_step"] == config.flops_per_token(4096) * 64 * 4096
    assert report["params_total"] >= config.num_params and report["params_total"] < 1.01 * config.num_params
    assert report["params_total"] / 4 < report["params_per_rank"] < report["params_total"] / 2  # a TP x PP quarter
    per_layer = [reports[c]["activation_bytes_per_layer"] for c in ("false", "selective", "full")]
    assert per_layer[0] > per_layer[1] > per_layer[2] > 0


def test_plan_chooses_the_pipeline_schedule_and_reports_each_candidates_bubble(capsys):
    from lit3d.planner.pipeline import CANDIDATES

    args = ["plan", "--model", "llama-8b", "--tensor_parallel_size", "2", "--pipeline_parallel_size", "4",
            "--seq_len", "4096", "--global_batch_size", "64"]  # fmt: skip
    main([*args, "--json"])
    report = json.loads(capsys.readouterr().out)
    weighed = {(c["pipeline_schedule"], c["virtual_pipeline_size"]): c for c in report["schedule_candidates"]}
    assert set(weighed) == set(CANDIDATES)
    chosen = weighed[report["pipeline_schedule"], report["layout"]["virtual_pipeline_size"]]
    assert chosen["fits"] and chosen["bubble"] == report["pipeline_bubble"]
    assert chosen["step_time_s"] == min(c["step_time_s"] for c in weighed.values() if c["fits"])
    # Memory is ample here: a zero-bubble schedule wins, with at most half of 1F1B's bubble.
    assert report["pipeline_schedule"] in ("zero_bubble", "zbv", "dualpipev")
    assert chosen["bubble"] <= weighed["1f1b", 1]["bubble"] / 2
    main(args)
    text = capsys.readouterr().out
    assert "pipeline schedules weighed" in text and "against 1F1B" in text and "<- chosen" in text
    # A schedule asked for is kept (and checked: DualPipe-V needs 2p micro-batches).
    main([*args, "--pipeline_schedule", "zbv", "--json"])
    assert json.loads(capsys.readouterr().out)["pipeline_schedule"] == "zbv"
    with pytest.raises(SystemExit, match="needs num_microbatches >= 2 x pipeline_parallel_size = 8"):
        main([*args, "--pipeline_schedule", "dualpipev", "--num_microbatches", "4", "--global_batch_size", "4"])


def test_a_search_runs_each_layout_with_its_fastest_schedule_that_fits():
    config, cluster = GPTConfig.from_name("llama-70b"), Cluster(nodes=4)
    fitting, _ = search(config, cluster, Training(seq_len=4096, global_batch_size=256), zero_stages=(1,))
    pipelined = [c for c in fitting if c.layout.pp > 1]
    assert pipelined
    for c in pipelined:
        assert c.plan.pipeline_schedule == c.parallelism.pipeline_schedule
        fits = [o["step_time_s"] for o in c.plan.schedule_candidates if o["fits"]]
        assert c.plan.step_time_s == min(fits)


def test_collectives_pay_a_latency_per_ring_hop():
    # ZeRO-3 over 2,048 ranks gathers every block twice per micro-batch: 2,047 hops each, seconds of latency that
    # bandwidth alone would not show; over 8 ranks it is milliseconds.
    config, latency = GPTConfig.from_name("llama-70b"), {}
    for dp in (8, 2048):  # one micro-batch per replica either way
        training, settings = Training(seq_len=4096, global_batch_size=dp), Parallelism(zero_stage=3)
        layout = Layout(dp=dp, tp=8, pp=1, devices_per_node=8)
        cluster = Cluster(nodes=dp, gpus_per_node=8)
        latency[dp] = estimate(config, cluster, layout, training, settings).communication_per_step["dp"]["latency_s"]
    assert latency[2048] > 1.0 and latency[8] < 0.02


def test_the_estimate_of_a_run_is_the_plan_of_its_settings_and_reads_nothing_else_of_the_strategy():
    """`plan_of_run` reads the strategy's `Parallelism`, layout, micro-batches, nodes and processes, and its module's
    config and trainer (a namespace holding only those answers nothing else), and plans them as `lit3d plan` does."""
    from dataclasses import asdict
    from types import SimpleNamespace

    from lit3d.planner import Request, plan
    from lit3d.planner.run import plan_of_run

    config = GPTConfig.from_name("tiny")
    settings = Parallelism(tensor_parallel_size=2, pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b",
                           zero_stage=2, sequence_parallel=True, mixed_precision_reduce="bfloat16")  # fmt: skip
    data = SimpleNamespace(global_batch_size=16, seq_len=64)
    trainer = SimpleNamespace(datamodule=data, accumulate_grad_batches=2, precision="bf16-mixed")
    strategy = SimpleNamespace(
        parallelism=settings,
        layout=Layout(dp=2, tp=2, pp=2, devices_per_node=8),
        num_microbatches=2,
        lightning_module=SimpleNamespace(config=config, trainer=trainer),
        num_nodes=1,
        num_processes=8,
    )
    planned = plan_of_run(strategy)
    given = {name: value for name, value in asdict(settings).items() if name != "data_parallel_size"}
    request = Request.given(config, Cluster(gpus_per_node=8), seq_len=64, global_batch_size=16,
                            accumulate_grad_batches=2, **{**given, "num_microbatches": 2})  # fmt: skip
    assert planned == plan(request).chosen.plan
    assert planned.num_microbatches == 2 and planned.layout["virtual_pipeline_size"] == 2
    in_fp32 = plan_of_run(
        SimpleNamespace(
            **{**vars(strategy), "parallelism": Parallelism(**{**given, "mixed_precision_reduce": "float32"})}
        )
    )
    assert planned.communication_per_step["dp"]["bytes"] < in_fp32.communication_per_step["dp"]["bytes"]


def test_pipeline_ranks_of_the_same_shapes_are_counted_once_and_as_each_alone():
    """The search counts a rank's states from its shapes (`stage_shapes`): the middle stages of a pipeline share one
    count, and every rank's equals the count of its own tensors with their own block numbers."""
    from dataclasses import asdict

    from lit3d.parallel.zero import ZeroPolicy
    from lit3d.planner.inputs import PRECISIONS
    from lit3d.planner.states import shapes_state
    from lit3d.planner.tensors import StageShapes, config_key, key_tensors, rank_shapes

    key, layout = config_key(GPTConfig.from_name("llama-8b")), Layout(dp=2, tp=2, pp=4, devices_per_node=8)
    shapes = rank_shapes(key, 4, 2, "loop")
    assert shapes[1] is shapes[2] and shapes[0] is not shapes[1]  # (rank 0 holds the embedding, rank 3 the head)
    precision = PRECISIONS["bf16-mixed"]
    for zero in (ZeroPolicy(0, 2), ZeroPolicy(1, 2), ZeroPolicy(2, 2), ZeroPolicy(3, 2)):
        for rank in range(4):
            alone = StageShapes(tuple(key_tensors(key, 4, 2, rank, "loop")))  # its own names and block numbers
            held = shapes_state(shapes[rank], layout, zero, precision, True, False)
            assert asdict(held) == asdict(shapes_state(alone, layout, zero, precision, True, False))


def test_a_rank_s_groups_and_kinds_count_as_its_tensors_do():
    """`StageShapes.sum` sums over a rank's repeating groups (the root, each kind of block once, times its count),
    `StageShapes.counted` over its distinct tensors and `StageShapes.kinds` names each tensor's kind: all as the tensors
    themselves count, for dense, MoE and LoRA models."""
    from lit3d.models.lora_settings import LoRA
    from lit3d.planner.tensors import config_key, rank_shapes

    for name, lora, ep in (("llama-8b", None, 1), ("moe-tiny", None, 2), ("llama-8b", LoRA(rank=8), 1)):
        key = config_key(GPTConfig.from_name(name), lora)
        layout = Layout(dp=4, tp=2, pp=2, devices_per_node=8, ep=ep)
        for shapes in {*rank_shapes(key, 2, 1, "loop"), *rank_shapes(key, 2, 2, "v")}:
            _check_groups_and_kinds(shapes, layout)


def _check_groups_and_kinds(shapes, layout):
    from functools import partial

    from lit3d.parallel.zero import ZeroPolicy
    from lit3d.planner.tensors import local_numel, stepped_numel

    tensors = list(shapes.tensors)
    for zero in (ZeroPolicy(0, 4), ZeroPolicy(1, 4), ZeroPolicy(3, 4)):
        assert shapes.sum(partial(stepped_numel, layout=layout, zero=zero)) == stepped_numel(tensors, layout, zero)
    numel = lambda group: sum(local_numel(t, 2, 4, ep=layout.ep) for t in group)
    assert shapes.sum(numel) == numel(tensors) == sum(n * numel([t]) for t, n in shapes.counted)
    kinds, order = shapes.kinds
    same = lambda t: (t.shape, t.tp_dim, t.expert, t.trains, t.name.rsplit(".", 2)[-2:])
    assert [same(kinds[i]) for i in order] == [same(t) for t in tensors]


def test_a_rank_s_shapes_are_its_tensors_with_its_blocks_numbered_from_0():
    """`stage_shapes` (made once for every rank alike) holds what `key_tensors` lists for the rank, its blocks
    renumbered in order: dense and MoE models (with dense first blocks), tied embeddings, adapters, given stages."""
    from dataclasses import replace

    from lit3d.models.lora_settings import LoRA
    from lit3d.planner.tensors import config_key, key_tensors, stage_shapes

    grids = ((2, 1, "loop"), (4, 1, "loop"), (2, 2, "loop"), (2, 2, "v"))
    for name, lora, layers in (
        ("llama-8b", None, None),
        ("moe-tiny", None, None),
        ("llama3.2-1b", LoRA(rank=8), None),
        ("tiny", None, (1, 3)),
    ):
        key = config_key(GPTConfig.from_name(name), lora, layers)
        for pp, virtual, placement in grids if layers is None else ((2, 1, "loop"),):
            for rank in range(pp):
                tensors = key_tensors(key, pp, virtual, rank, placement)
                order = {b: i for i, b in enumerate(dict.fromkeys(t.block for t in tensors if t.block is not None))}
                numbered = [
                    t if t.block is None else replace(t, name=f"blocks.{order[t.block]}.{t.name.split('.', 2)[2]}",
                                                      block=order[t.block])
                    for t in tensors
                ]  # fmt: skip
                assert list(stage_shapes(key, pp, virtual, rank, placement).tensors) == numbered, (name, pp, rank)


def test_gradients_unsharded_across_micro_steps_leave_a_rank_s_least_peak_as_the_shards():
    """The search weighs ZeRO-2/3 with their gradients unsharded across the micro-steps only where the shards' states
    and buffers alone fit (`Held.floors`): the unsharded run's are the same."""
    from dataclasses import replace

    from lit3d.models.lora_settings import LoRA
    from lit3d.planner.inputs import PLANNING_DEFAULTS, Case
    from lit3d.planner.memory import held_by_stage

    runs = [
        ("llama-8b", None, Layout(dp=8, tp=1, pp=1, devices_per_node=8), False),
        ("llama-8b", None, Layout(dp=4, tp=2, pp=1, devices_per_node=8), True),
        ("llama-8b", LoRA(rank=8), Layout(dp=8, tp=1, pp=1, devices_per_node=8), False),
        ("moe-tiny", None, Layout(dp=4, tp=2, pp=1, devices_per_node=8, ep=2), False),
    ]
    for name, lora, layout, offload in runs:
        config, training = GPTConfig.from_name(name), Training(seq_len=128, global_batch_size=64, lora=lora)
        for zero in (2, 3) if not offload else (3,):
            sharded = replace(PLANNING_DEFAULTS, zero_stage=zero, offload=offload).at(layout)
            unsharded = replace(sharded, accumulate_unsharded=True)
            cases = [Case(config, Cluster(), layout, training, run) for run in (sharded, unsharded)]
            floors = [held_by_stage(case).floors for case in cases]
            assert floors[0] == floors[1], (name, layout, zero)
