"""Speed and memory levers (activation checkpointing, compile) and the throughput/MFU callback, on CPU."""

import json
import math
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import forked
import pytest
import torch
import torch.distributed as dist
from helpers import fit, logged
from torch.utils._python_dispatch import TorchDispatchMode

from lit3d import GPT
from lit3d.callbacks import CommReport, Throughput
from lit3d.data import TextDataModule
from lit3d.models.tp_plan import TENSOR_PARALLEL_PLAN
from lit3d.models.transformer import Transformer
from lit3d.parallel.layout import Layout
from lit3d.planner.hardware import identify

ROOT = Path(__file__).resolve().parents[1]


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """A real one-rank gloo group, so the strategy's own `parallelize_network` runs in-process."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def run_step(small_config, world, count_ops=False, **levers):
    """Loss, gradients and the ops backward ran, for the network parallelised with ``levers`` (1 rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    from lit3d.parallel.settings import Parallelism
    from lit3d.strategies.meshes import ParallelMeshes
    from lit3d.strategies.parallelize import parallelize_network

    torch.manual_seed(0)
    network = Transformer(small_config)
    network.reset_parameters(seed=0)
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    meshes = ParallelMeshes(Layout(1, 1, 1, 1), world=mesh, replicas=mesh)
    parallelize_network(network, TENSOR_PARALLEL_PLAN, Parallelism(zero_stage=0, **levers), meshes, 0)
    tokens = torch.randint(0, small_config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    loss = torch.nn.functional.cross_entropy(network(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    backward_ops = CountOps() if count_ops else nullcontext()
    with backward_ops:  # NOTE: compiled code under a dispatch mode runs differently; count only eager runs
        loss.backward()
    grads = {name: p.grad.clone() for name, p in network.named_parameters()}
    return loss.detach(), grads, getattr(backward_ops, "counts", {})


def test_activation_checkpointing_recomputes_what_it_says_and_changes_nothing(small_config, world_of_one):
    loss, grads, plain = run_step(small_config, world_of_one, count_ops=True)
    for mode in ("full", "selective"):
        loss_ac, grads_ac, ops = run_step(small_config, world_of_one, count_ops=True, activation_checkpointing=mode)
        torch.testing.assert_close(loss_ac, loss, rtol=0, atol=0)
        for name in grads:
            torch.testing.assert_close(grads_ac[name], grads[name], rtol=1e-6, atol=1e-7, msg=name)
        if mode == "full":  # every block's matmuls run again in backward
            assert ops.get("mm", 0) > plain.get("mm", 0)
        else:  # matmul outputs are kept: no matmul runs again, but the elementwise ops (the norms) do
            assert ops.get("mm", 0) == plain.get("mm", 0)
            assert ops.get("rsqrt", 0) > plain.get("rsqrt", 0)


def test_compiled_blocks_give_the_same_loss_and_gradients(small_config, world_of_one):
    loss, grads, _ = run_step(small_config, world_of_one)
    loss_c, grads_c, _ = run_step(small_config, world_of_one, compile="aot_eager", activation_checkpointing="full")
    torch.testing.assert_close(loss_c, loss, rtol=1e-6, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_bad_recompute_mode_is_refused():
    from lit3d.strategies import Parallel3DStrategy

    with pytest.raises(ValueError, match="activation_checkpointing='everything'"):
        Parallel3DStrategy(activation_checkpointing="everything")


def test_throughput_is_in_the_progress_bar_and_the_log_and_mfu_only_for_known_devices(tmp_path, monkeypatch):
    data = TextDataModule(seq_len=32, global_batch_size=4)
    trainer, log_dir = fit(GPT("tiny"), data, tmp_path, max_steps=5, callbacks=[Throughput(warmup=1)])
    assert "perf/tokens_per_s" in trainer.progress_bar_metrics
    tokens = logged(log_dir, "perf/tokens_per_s")
    step = logged(log_dir, "perf/step_s")
    assert len(tokens) == 4 and all(t > 0 for t in tokens)  # steps 2..5 (step 1 is warm-up)
    assert tokens == pytest.approx([4 * 32 / s for s in step])
    assert logged(log_dir, "perf/mfu") == []  # a CPU is not in the table: no MFU rather than a wrong one

    # On a known device, MFU = model FLOPs per token x tokens/s per device / the device's peak.
    monkeypatch.setattr("lit3d.callbacks.device_peak_flops", lambda device: 1e12)
    model = GPT("tiny")
    trainer, log_dir = fit(model, data, tmp_path / "known", max_steps=4, callbacks=[Throughput(warmup=1)])
    mfu, per_device = logged(log_dir, "perf/mfu"), logged(log_dir, "perf/tokens_per_s_per_device")
    assert len(mfu) == 3 and "perf/mfu" in trainer.progress_bar_metrics
    assert mfu == pytest.approx([model.config.flops_per_token(32) * t / 1e12 for t in per_device])


def test_throughput_steps_end_where_the_optimizer_steps_also_at_a_short_last_window(
    tmp_path, small_config, text_folder
):
    """3 batches an epoch, accumulating 2: each epoch's steps end after batches 2 and 3 (a window of one). The
    callback and the model's train_loss use Lightning's own rule (`lit3d.models.loop.ends_optimizer_step`)."""
    data = TextDataModule(data_path=str(text_folder), seq_len=16, global_batch_size=2)
    trainer, log_dir = fit(
        GPT(small_config),
        data,
        tmp_path,
        max_steps=4,
        limit_train_batches=3,
        accumulate_grad_batches=2,
        callbacks=[Throughput(warmup=0)],
    )
    assert trainer.global_step == 4 and trainer.current_epoch == 2
    assert len(logged(log_dir, "train_loss")) == 4
    assert len(logged(log_dir, "perf/step_s")) == 3  # every step after the first (whose start is unknown)


def test_known_gpus_are_identified_and_unknown_ones_are_not():
    assert identify("NVIDIA H100 80GB HBM3").name == "H100"
    assert identify("NVIDIA H200").peak_tflops == 989.0
    assert identify("NVIDIA A100-SXM4-40GB").name == "A100 40GB"
    assert identify("NVIDIA GeForce GTX 1080") is None


def test_flops_per_token_is_6n_plus_attention():
    from lit3d import GPTConfig

    config = GPTConfig.from_name("llama-8b")
    n = config.num_params - config.embedding_params  # the embedding lookup is not a matmul
    assert config.flops_per_token(8192) == 6 * n + 12 * 32 * 4096 * 8192
    assert math.isclose(config.flops_per_token(8192) / 1e9, 6 * 7.5 + 12.9, rel_tol=0.02)


@pytest.mark.ranks
def test_strategy_benchmark_compares_with_lightning_and_reports_traffic_next_to_the_planner(tmp_path):
    """A tiny run of `benchmarks/strategies.py`: lit3d TP2 against ModelParallelStrategy with the same plan."""
    out = tmp_path / "bench.json"
    run = forked.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "strategies.py"),
            "--configs",
            "mp tp2",
            "3d tp2",
            "--rounds",
            "1",
            "--steps",
            "2",
            "--warmup",
            "2",
            "--n-layer",
            "2",
            "--d-model",
            "128",
            "--seq-len",
            "32",
            "--json",
            str(out),
        ],
        cwd=tmp_path,
        env=dict(os.environ),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["3d tp2"]["ratio"] == results["3d tp2"]["median_step_s"] / results["mp tp2"]["median_step_s"]
    assert "x mp tp2" in run.stdout and "communication in one step" in run.stdout
    ours, theirs = results["3d tp2"]["comm"], results["mp tp2"]["comm"]
    assert ours["measured"]["tp"] > 0 and ours["measured"]["tp"] == theirs["measured"]["tp"]  # the same plan
    assert 0 <= ours["measured"]["tp"] - ours["planned"]["tp"] <= 256


def test_comm_report_refuses_a_bad_step_and_says_when_it_measured_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"CommReport\(step=-1\)"):
        CommReport(step=-1)
    report = CommReport(step=5)
    with pytest.warns(UserWarning, match="CommReport measured nothing: training ended before step 5"):
        fit(GPT("tiny"), TextDataModule(seq_len=32, global_batch_size=4), tmp_path, max_steps=2, callbacks=[report])
    assert report.measured is None
