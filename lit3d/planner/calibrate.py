"""Measure the machine this runs on as the planner's clock sees a device: `lit3d calibrate`.

Each of ``processes`` processes (spawned, gloo, ``cores / processes`` threads each, all at once so that they share the
machine as a rehearsal's ranks do) times:

- fp32 GEMMs of 2,048 x 512 outputs at three inner dimensions: the peak and ``gemm_half_dim`` that fit them;
- causal attention (PyTorch SDPA) forward and backward, as shares of that peak;
- a block's elementwise work (an RMSNorm, a SwiGLU product) over ``tokens`` rows, forward and backward: the bytes/s
  it reaches, its bytes counted as the clock counts them (rows of a rehearsal's size, so caches count as they do
  there);
- a chain of tiny operations through autograd: the fixed time per operator; tiny column-parallel linears (DTensor)
  against plain ones: the host's time per split linear;
- an all-reduce of 2 MiB and of one float, each right after a GEMM: the link's bandwidth and a collective's latency
  as a step meets them.

One process also times a trivial Lightning fit: the loop's own time per step. The profile (a JSON file) is a
`lit3d.planner.hardware.GPU` with its `lit3d.planner.calibration.Efficiencies` and the link's numbers; ``lit3d plan
--gpu FILE`` plans with it. Collectives hide nothing here (``overlap_cost`` 1: they run on the cores that compute).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from lit3d.planner.calibration import BACKWARD_ELEMENTWISE, CPU, Efficiencies
from lit3d.planner.hardware import GPU, GPUS, cpu_share
from lit3d.planner.inputs import Cluster
from lit3d.planner.work import NORM, SWIGLU
from lit3d.quiet import lightning_info_silenced

GEMM_ROWS, GEMM_COLUMNS, GEMM_KS = 2048, 512, (64, 256, 1024)
GEMM_SIDE = 1024  # of the GEMM the collectives follow


def timed_once(work: Callable[[], Any]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def timed(work: Callable[[], Any], repeat: int = 5) -> float:
    """The median seconds of ``work`` over ``repeat`` runs after one warm-up."""
    work()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fit_gemm(throughput: dict[int, float]) -> tuple[float, float]:
    """(half_dim, peak) of ``throughput = peak · k / (k + half_dim)`` closest (in log) to FLOP/s measured per k."""

    def peak_of(half: float) -> float:
        return statistics.fmean(value * (k + half) / k for k, value in throughput.items())

    def error(half: float) -> float:
        peak = peak_of(half)
        return sum(math.log(value / (peak * k / (k + half))) ** 2 for k, value in throughput.items())

    half = min((float(h) for h in range(0, 1025, 8)), key=error)
    return half, peak_of(half)


def kernel_works(tokens: int, width: int = 256) -> dict[str, tuple[Callable[[], Any], float]]:
    """What `measure_kernels` times, each with the FLOPs (or, elementwise, the bytes as `lit3d.planner.work` counts
    them) it does: GEMMs of a rehearsal's shapes, causal attention forward and forward + backward, a block's RMSNorm
    and SwiGLU product forward and backward, and a chain of 100 tiny operators through autograd."""
    import torch
    import torch.nn.functional as F

    works: dict[str, tuple[Callable[[], Any], float]] = {}
    for k in GEMM_KS:  # thousands of tokens by a few hundred features
        a, b = torch.randn(GEMM_ROWS, k), torch.randn(k, GEMM_COLUMNS)
        works[f"gemm {k}"] = (lambda a=a, b=b: a @ b, 2 * GEMM_ROWS * GEMM_COLUMNS * k)
    batch, heads, seq, dim = 4, 8, 256, 32
    q, k, v = (torch.randn(batch, heads, seq, dim, requires_grad=True) for _ in range(3))
    attention = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn(batch, heads, seq, dim)
    causal = 4 * batch * heads * seq * seq * dim / 2
    works["attention"] = (attention, causal)
    works["attention and backward"] = (lambda: torch.autograd.grad(attention(), (q, k, v), grad), causal)
    hidden = torch.randn(tokens, width, requires_grad=True)
    gate, up = (torch.randn(tokens, 3 * width, requires_grad=True) for _ in range(2))
    norm = torch.nn.RMSNorm(width)
    elementwise = lambda: (norm(hidden).sum() + (F.silu(gate) * up).sum()).backward()
    forward = NORM[0][0] * tokens * width + SWIGLU[0][0] * tokens * 3 * width
    works["elementwise"] = (elementwise, (1 + BACKWARD_ELEMENTWISE) * forward)
    tiny = torch.ones(4, requires_grad=True)

    def chain() -> None:
        value = tiny
        for _ in range(100):
            value = value * 1.0001
        value.sum().backward()

    works["operators"] = (chain, 100 * 3)  # each operator: one kernel forward, about two backward
    return works


def measure_kernels(tokens: int, rounds: int = 7, repeat: int = 3) -> dict[str, float]:
    """This process's GEMM, attention, elementwise and per-operator numbers: each work of `kernel_works` timed
    ``repeat`` times in a row per round (its fastest kept), the rounds interleaved so that a slow moment of the machine
    hits all works alike; medians over the rounds."""
    works = kernel_works(tokens)
    times: dict[str, list[float]] = {name: [] for name in works}
    for work, _ in works.values():
        work()  # warm-up
    for _ in range(rounds):
        for name, (work, _) in works.items():
            times[name].append(min(timed_once(work) for _ in range(repeat)))
    seconds = {name: statistics.median(values) for name, values in times.items()}
    rate = {name: works[name][1] / seconds[name] for name in works}
    half, peak = fit_gemm({k: rate[f"gemm {k}"] for k in GEMM_KS})
    backward = seconds["attention and backward"] - seconds["attention"]
    return {
        "peak": peak,
        "half_dim": half,
        "attention_forward": rate["attention"] / peak,
        "attention_backward": 2.5 * works["attention"][1] / backward / peak,
        "bandwidth": rate["elementwise"],
        "kernel_overhead_s": 1 / rate["operators"],
    }


def measure_links(world: int, repeat: int = 30) -> dict[str, float]:
    """Bus bandwidth (bytes/s, as a ring all-reduce counts it) and latency (s) of gloo all-reduces as a training step
    meets them: each right after a GEMM on every rank, less the GEMM alone (so the wait for the slower rank, and the
    cores the collective shares with compute, count as they do in a step)."""
    import torch
    import torch.distributed as dist

    if world == 1:
        return {"bandwidth": 0.0, "latency": 0.0}
    a, b = torch.randn(GEMM_SIDE, 256), torch.randn(256, GEMM_SIDE)
    small, big = torch.zeros(1), torch.zeros(2**19)  # one float; 2 MiB, a rehearsal's activations
    runs = {
        "gemm": lambda: a @ b,
        "small": lambda: (a @ b, dist.all_reduce(small)),
        "big": lambda: (a @ b, dist.all_reduce(big)),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):  # interleaved, so that slow moments of the machine hit all three alike
        for name, work in runs.items():
            dist.barrier()
            start = time.perf_counter()
            work()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values[3:]) for name, values in times.items()}
    latency = max(median["small"] - median["gemm"], 0.0)
    moved = 2 * (world - 1) / world * big.numel() * 4
    return {"bandwidth": moved / max(median["big"] - median["gemm"] - latency, 1e-6), "latency": latency}


def measure_split_linear_overhead(world: int, count: int = 16) -> float:
    """Seconds of the host's work per tensor-parallel linear (forward and backward) beyond a plain one's: DTensor's
    sharding propagation and wrapping. ``count`` tiny column-parallel linears of one input that needs no gradient,
    so that no collective runs, against as many plain ones."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    if world == 1:
        return 0.0
    linears = lambda: torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(count))
    mesh = init_device_mesh("cpu", (world,))
    split = parallelize_module(linears(), mesh, {str(i): ColwiseParallel() for i in range(count)})
    plain, x = linears(), torch.randn(4, 64)
    step = lambda modules: sum(m(x).sum() for m in modules).backward()
    return max(timed(lambda: step(split), 15) - timed(lambda: step(plain), 15), 0.0) / count


def measure_step_overhead(steps: int = 30) -> float:
    """Seconds per step of Lightning's loop around a one-parameter model on the CPU."""
    import lightning as L
    import torch

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return (self.weight * batch).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    loader = torch.utils.data.DataLoader(torch.ones(steps * 2, 1), batch_size=1)
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with lightning_info_silenced():  # a means to a number, not a fit the user ran
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps * 2, **quiet)
        start = time.perf_counter()
        trainer.fit(Tiny(), loader)
    return (time.perf_counter() - start) / (steps * 2)


def _worker(rank: int, world: int, port: int, threads: int, tokens: int, folder: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)  # (the calling process's: `calibrate`)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        dist.barrier()
        kernels = measure_kernels(tokens)
        dist.barrier()
        result = {
            **kernels,
            **{f"link_{k}": v for k, v in measure_links(world).items()},
            "split_linear_s": measure_split_linear_overhead(world),
        }
        Path(folder, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def calibrate(processes: int = 1, tokens: int = 2048) -> dict[str, Any]:
    """The profile of one of ``processes`` processes sharing this machine (see the module's docstring)."""
    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    if processes < 1:
        raise ValueError(f"processes={processes} must be a positive integer")
    threads = max(1, (os.cpu_count() or 1) // processes)
    with tempfile.TemporaryDirectory() as folder:
        # NOTE: the processes meet at a store this process listens on from the start (a port the system picks), not at
        # a port found free and bound later: another program on the machine can take such a port in between.
        store = TCPStore("127.0.0.1", 0, is_master=True)
        # NOTE: forked where Linux allows it (this process has imported torch and runs only the store's thread, which
        # the ranks do not use): a spawned rank imports torch again, about 9 s of a core on a small machine.
        method = "fork" if sys.platform == "linux" else "spawn"
        mp.start_processes(
            _worker, args=(processes, store.port, threads, tokens, folder), nprocs=processes, start_method=method
        )
        del store
        ranks = [json.loads(Path(folder, f"{r}.json").read_text()) for r in range(processes)]
    m = {key: statistics.median(rank[key] for rank in ranks) for key in ranks[0]}
    return profile(processes, m, measure_step_overhead())


def profile(processes: int, m: dict[str, float], step_overhead: float) -> dict[str, Any]:
    """The JSON profile of measurements ``m`` (medians over the ranks)."""
    share = cpu_share(processes)
    link = m["link_bandwidth"] / 1e9 if processes > 1 else GPUS["CPU"].intra_node_gbps
    efficiency = replace(
        CPU,
        gemm=1.0,
        gemm_half_dim=m["half_dim"],
        attention=(("sdpa", m["attention_forward"], m["attention_backward"]),),
        memory=1.0,
        kernel_overhead_us=m["kernel_overhead_s"] * 1e6,
        overlap_cost=1.0,
        link=1.0,
        step_overhead_ms=step_overhead * 1e3,
        split_linear_us=m["split_linear_s"] * 1e6,
    )
    gpu = replace(
        share,
        name=f"this CPU, {processes} process(es)",
        peak_tflops=m["peak"] / 1e12,
        intra_node_gbps=link,
        inter_node_gbps=link,
        memory_bandwidth_gbps=m["bandwidth"] / 1e9,
        efficiency=efficiency,
    )
    return {"gpu": asdict(gpu), "collective_latency_us": m["link_latency"] * 1e6, "processes": processes}


def cluster_of(path: str | os.PathLike, gpus_per_node: int, nodes: int = 1) -> Cluster:
    """The planner's cluster of ``nodes`` x ``gpus_per_node`` processes of the profile at ``path``."""
    gpu, latency = load_profile(path)
    return Cluster.of(
        gpu, nodes, gpus_per_node, collective_latency_us=latency, intra_node_hop_us=0.0, inter_node_hop_us=0.0
    )


def load_profile(path: str | os.PathLike) -> tuple[GPU, float]:
    """The device and the collective latency (µs) of a profile written by `calibrate`."""
    data = json.loads(Path(path).read_text())
    spec = dict(data["gpu"])
    eff = dict(spec.pop("efficiency"))
    eff["attention"] = tuple(tuple(entry) for entry in eff["attention"])
    return GPU(**spec, efficiency=Efficiencies(**eff)), float(data["collective_latency_us"])
