"""Step time of lit3d's Parallel3DStrategy against Lightning's own strategies: same model, same data, same run.

    python benchmarks/strategies.py                  # CPU: under five minutes on 2 cores (4m19s)
    python benchmarks/strategies.py --rounds 5 --n-layer 8 --d-model 512

Every configuration trains the same GPT on the same batches (the embedded corpus). Configurations with the
same number of processes share one group of spawned processes and run in interleaved rounds (A B C, A B C, ...),
so slow phases of a shared machine hit all of them alike (each round starts one configuration later); a
configuration's step time is the median, over rounds, of the median wall time between optimizer steps after a
warm-up. Each lit3d layout is printed as a
ratio against the Lightning strategy that does the same job, measured in this same run:

    Parallel3DStrategy 1x1x1          vs  auto (single device)
    Parallel3DStrategy DP, ZeRO-0/1   vs  ddp
    Parallel3DStrategy DP, ZeRO-3     vs  fsdp (needs GPUs), else ModelParallelStrategy with FSDP2 over DP
    Parallel3DStrategy TP             vs  ModelParallelStrategy with the same tensor-parallel plan
    Parallel3DStrategy DP2 EP2        vs  Parallel3DStrategy DP2, experts replicated (an MoE model: --experts)
    Parallel3DStrategy CP2, CP4       vs  Parallel3DStrategy 1x1x1 (long sequences: --context)
    Parallel3DStrategy FP8 linears    vs  the same layout in bf16 (--float8: every run in bf16-mixed)
    GPT(optimizer="muon")             vs  the same layout with AdamW (--muon: 1x1x1, DP2 ZeRO-1, ZeRO-3, TP2, PP2)

Long sequences (``--context``): each CP rank keeps 1/cp of every sequence, so the activations autograd keeps per
rank (column ``act MB``, measured with saved-tensor hooks in a warm-up step) fall by cp, while each rank's step
time shows the ring's cost (on a CPU machine, also that cp processes share its cores)::

    python benchmarks/strategies.py --context --seq-len 4096 --n-layer 2 --d-model 128 --global-batch-size 1 \
        --configs "3d 1x1x1" "3d cp2" "3d cp4"

A ratio below 1 means lit3d is faster. ModelParallelStrategy leaves the parallelisation to the module: here a
GPT subclass applies the same TP plan and FSDP2 in ``configure_model``, as Lightning's documentation shows.

Communication: in the first round every configuration measures the bytes each rank sends per axis in one step
(`lit3d.callbacks.CommReport`, under PyTorch's CommDebugMode), printed next to the planner's numbers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lit3d import GPT  # noqa: E402
from lit3d.models.transformer import loss_parallel_scope  # noqa: E402
from lit3d.strategies.split.tensor_parallel import apply_tensor_parallel  # noqa: E402

# name -> (processes, strategy: a Lightning name, ("mp", dp, tp) for ModelParallelStrategy or Parallel3DStrategy
# kwargs, baselines: the first one measured in the run is used)
CONFIGS = {
    "auto": (1, "auto", ()),
    "3d 1x1x1": (1, {"zero_stage": 0}, ("auto",)),
    "ddp": (2, "ddp", ()),
    "3d dp2 zero0": (2, {"zero_stage": 0}, ("ddp",)),
    "3d dp2 zero1": (2, {"zero_stage": 1}, ("ddp",)),
    "fsdp": (2, "fsdp", ()),
    "mp dp2 fsdp2": (2, ("mp", 2, 1), ()),
    "3d dp2 zero3": (2, {"zero_stage": 3}, ("fsdp", "mp dp2 fsdp2")),
    "mp tp2": (2, ("mp", 1, 2), ()),
    "3d tp2": (2, {"tensor_parallel_size": 2}, ("mp tp2",)),
    "3d pp2": (2, {"pipeline_parallel_size": 2, "zero_stage": 0}, ("3d 1x1x1",)),
    # MoE models only (--experts): the experts split over 2 ranks, against every rank holding all of them
    "3d dp2 ep2": (2, {"zero_stage": 1, "expert_parallel_size": 2}, ("3d dp2 zero1",)),
    # Long sequences only (--context): every sequence split over 2 or 4 ranks, against one rank holding it all
    "3d cp2": (2, {"zero_stage": 0, "context_parallel_size": 2}, ("3d 1x1x1",)),
    "3d cp4": (4, {"zero_stage": 0, "context_parallel_size": 4}, ("3d 1x1x1",)),
    # FP8 only (--float8): the blocks' linears in FP8 against the same layout in bf16
    "3d 1x1x1 fp8": (1, {"zero_stage": 0, "float8": "tensorwise"}, ("3d 1x1x1",)),
    "3d 1x1x1 fp8 rowwise": (1, {"zero_stage": 0, "float8": "rowwise"}, ("3d 1x1x1",)),
    "3d dp2 zero3 fp8": (2, {"zero_stage": 3, "float8": "tensorwise", "float8_all_gather": True}, ("3d dp2 zero3",)),
    # Muon only (--muon): the hidden matrices orthogonalized (each gathered whole where it is split), against AdamW
    "3d 1x1x1 muon": (1, {"zero_stage": 0}, ("3d 1x1x1",)),
    "3d dp2 zero1 muon": (2, {"zero_stage": 1}, ("3d dp2 zero1",)),
    "3d dp2 zero3 muon": (2, {"zero_stage": 3}, ("3d dp2 zero3",)),
    "3d tp2 muon": (2, {"tensor_parallel_size": 2}, ("3d tp2",)),
    "3d pp2 muon": (2, {"pipeline_parallel_size": 2, "zero_stage": 0}, ("3d pp2",)),
}
MOE_ONLY = {"3d dp2 ep2"}
CONTEXT_ONLY = {"3d cp2", "3d cp4"}
FLOAT8_ONLY = {"3d 1x1x1 fp8", "3d 1x1x1 fp8 rowwise", "3d dp2 zero3 fp8"}
MUON_ONLY = {name for name in CONFIGS if name.endswith(" muon")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every configuration")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument(
        "--experts",
        type=int,
        default=0,
        help="an MoE model: this many experts per block (2 per token, after one dense block)",
    )
    parser.add_argument("--context", action="store_true", help="run the context-parallel configurations too")
    parser.add_argument("--float8", action="store_true", help="run the FP8 configurations too, every run in bf16-mixed "
                        "(on a CPU FP8 matmuls are emulated: time them on a GPU)")  # fmt: skip
    parser.add_argument("--muon", action="store_true", help="run the Muon configurations too (GPT(optimizer='muon'))")
    parser.add_argument("--muon-ns-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="GPT.muon_ns_dtype of the Muon configurations")  # fmt: skip
    parser.add_argument(
        "--optimizer",
        default="auto",
        choices=["auto", "foreach", "fused"],
        help="AdamW implementation (GPT.optimizer_impl), the same for every configuration",
    )
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), help=f"subset of: {', '.join(CONFIGS)}")
    parser.add_argument("--json", type=str, default=None, help="also write the results to this file")
    parser.add_argument(
        "--predict",
        action="store_true",
        help="first measure this machine (`lit3d calibrate`, for 1 and 2 processes), then print the planner's step "
        "time of each lit3d layout on it beside the measured one",
    )
    args = parser.parse_args()
    for name in ("steps", "rounds", "n_layer", "d_model", "seq_len", "global_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.warmup < 0:
        parser.error(f"--warmup={args.warmup} must be at least 0")
    unknown = [name for name in args.configs if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown --configs {unknown}; known: {', '.join(CONFIGS)}")

    gpu = torch.cuda.is_available()
    cores = os.cpu_count() or 1
    moe = f", {args.experts} experts (2 per token)" if args.experts else ""
    print(
        f"model: n_layer={args.n_layer} d_model={args.d_model}{moe}, seq_len={args.seq_len}, global batch "
        f"{args.global_batch_size}, AdamW {args.optimizer}; {'GPU' if gpu else f'CPU, {cores} cores'}; "
        f"{args.rounds} rounds of {args.steps} steps",
        flush=True,
    )
    results: dict[str, dict] = {}
    runnable: dict[int, list[str]] = {}
    for name in args.configs:
        processes, strategy, _ = CONFIGS[name]
        if strategy == "fsdp" and not gpu:
            results[name] = {"skipped": "Lightning's FSDPStrategy requires GPUs"}
        elif name in MOE_ONLY and not args.experts:
            results[name] = {"skipped": "needs an MoE model (--experts)"}
        elif name in CONTEXT_ONLY and not args.context:
            results[name] = {"skipped": "a long-sequence configuration (--context)"}
        elif name in FLOAT8_ONLY and not args.float8:
            results[name] = {"skipped": "an FP8 configuration (--float8)"}
        elif name in MUON_ONLY and not args.muon:
            results[name] = {"skipped": "a Muon configuration (--muon)"}
        elif gpu and processes > torch.cuda.device_count():
            results[name] = {"skipped": f"needs {processes} GPUs"}
        else:
            runnable.setdefault(processes, []).append(name)
    started = time.time()
    if args.predict:  # the machine's profile for each process count, measured before the layouts run
        from lit3d.planner.calibrate import calibrate

        folder = tempfile.mkdtemp()
        args.profiles = {n: str(Path(folder, f"{n}.json")) for n in runnable}
        for n, path in args.profiles.items():
            Path(path).write_text(json.dumps(calibrate(n)))
    for processes, names in runnable.items():
        results.update(run_group(processes, names, args, threads=max(1, cores // processes)))

    tokens = args.global_batch_size * args.seq_len
    print(
        f"\n{'configuration':<16}{'ms/step':>10}{'tokens/s':>11}{'mem MB':>10}{'act MB':>10}   vs baseline (same run)"
    )
    for name in args.configs:
        result = results[name]
        if "skipped" in result:
            print(f"{name:<16}{'-':>10}{'-':>11}{'-':>10}   skipped: {result['skipped']}")
            continue
        step, baselines = result["median_step_s"], CONFIGS[name][2]
        baseline = next((b for b in baselines if "median_step_s" in results.get(b, {})), None)
        versus = f"({' / '.join(baselines)} not measured)" if baselines else ""
        if baseline:
            result["ratio"] = step / results[baseline]["median_step_s"]
            versus = f"{result['ratio']:.3f} x {baseline}"
        memory = f"{result['peak_bytes'] / 2**20:>10.0f}{result['activation_bytes'] / 2**20:>10.1f}"
        print(f"{name:<16}{step * 1000:>10.1f}{tokens / step:>11.0f}{memory}   {versus}")
    print_comm_report(results, args.configs)
    if args.predict:
        print_predictions(results, args.configs)
    print(f"({time.time() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def print_comm_report(results: dict[str, dict], names: list[str]) -> None:
    """Bytes per axis the busiest rank sent in one step: measured, and the planner's for lit3d's layouts."""
    print("\ncommunication in one step, MiB sent by the busiest rank: measured under CommDebugMode, and planned")
    print(
        f"{'configuration':<16}"
        + "".join(f"{axis:>10}{'planned':>10}" for axis in ("tp", "dp", "ep", "cp"))
        + f"{'other':>10}"
    )
    for name in names:
        comm = results[name].get("comm")
        if not comm:
            continue
        measured, planned = comm["measured"], comm["planned"] or {}
        row = f"{name:<16}"
        for axis in ("tp", "dp", "ep", "cp"):
            plan = f"{planned[axis] / 2**20:.3f}" if axis in planned else "-"
            row += f"{measured.get(axis, 0.0) / 2**20:>10.3f}{plan:>10}"
        print(row + f"{measured['other'] / 2**20:>10.3f}")


def print_predictions(results: dict[str, dict], names: list[str]) -> None:
    """The planner's step time on this machine's profile beside the measured one, and whether the planner orders
    every pair of layouts that the measurement tells apart (their rounds do not overlap) as measured."""
    rows = {name: results[name] for name in names if results[name].get("predicted_step_s")}
    if not rows:
        return
    print("\nthe planner's clock on this machine (`lit3d calibrate` profiles measured in this run)")
    print(f"{'configuration':<16}{'measured ms':>12}{'rounds ms':>14}{'planned ms':>12}{'ratio':>8}")
    for name, result in rows.items():
        measured, planned, rounds = result["median_step_s"], result["predicted_step_s"], result["per_round_s"]
        spread = f"{min(rounds) * 1000:.0f}-{max(rounds) * 1000:.0f}"
        print(f"{name:<16}{measured * 1000:>12.1f}{spread:>14}{planned * 1000:>12.1f}{planned / measured:>8.3f}")
    apart, agree = 0, 0
    for a, b in itertools.combinations(rows, 2):
        first, second = sorted((a, b), key=lambda name: rows[name]["median_step_s"])
        if max(rows[first]["per_round_s"]) < min(rows[second]["per_round_s"]):  # told apart
            apart += 1
            agree += rows[first]["predicted_step_s"] < rows[second]["predicted_step_s"]
    order = lambda key: " < ".join(sorted(rows, key=lambda name: rows[name][key]))
    print(f"fastest first, measured: {order('median_step_s')}\nfastest first, planned:  {order('predicted_step_s')}")
    print(f"pairs the measurement tells apart (rounds not overlapping): {apart} of {len(rows) * (len(rows) - 1) // 2}"
          f", ordered as measured by the planner: {agree}")  # fmt: skip


def run_group(processes: int, names: list[str], args: argparse.Namespace, threads: int) -> dict[str, dict]:
    """All ``names`` (same process count) in one spawn, interleaved over ``args.rounds`` rounds."""
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # Each round starts with the next configuration, so none always runs first (or right after another).
        schedule = [(r, names[(r + i) % len(names)]) for r in range(args.rounds) for i in range(len(names))]
        # NOTE: forked, not spawned: the ranks start from this process, which has imported torch and Lightning (a
        # spawned rank imports them again: about 9 s of a core each on a small machine) and runs no thread of its own.
        mp.start_processes(
            _worker, args=(processes, port, schedule, vars(args), threads, tmp), nprocs=processes, start_method="fork"
        )
        results = {}
        for name in names:
            runs = [json.loads((Path(tmp) / f"{r}-{name}.json").read_text()) for r in range(args.rounds)]
            comm = Path(tmp) / f"0-{name}-comm.json"
            results[name] = {
                "median_step_s": statistics.median(run["median_step_s"] for run in runs),
                "per_round_s": [run["median_step_s"] for run in runs],
                "peak_bytes": max(run["peak_bytes"] for run in runs),
                "activation_bytes": max(run["activation_bytes"] for run in runs),
                "comm": json.loads(comm.read_text()) if comm.exists() else None,
            }
            predicted = Path(tmp) / f"0-{name}-predicted.json"
            if predicted.exists():
                results[name]["predicted_step_s"] = json.loads(predicted.read_text())
            print(
                f"  {name}: {results[name]['median_step_s'] * 1000:.1f} ms/step "
                f"(rounds: {', '.join(f'{t * 1000:.0f}' for t in results[name]['per_round_s'])})",
                flush=True,
            )
        return results


def _worker(rank: int, processes: int, port: int, schedule: list, args: dict, threads: int, tmp: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(processes),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        HF_DATASETS_DISABLE_PROGRESS_BARS="1",
    )
    torch.set_num_threads(threads)
    import logging

    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from benchmarks.step_timer import StepTimer
    from lit3d import GPTConfig
    from lit3d.callbacks import CommReport
    from lit3d.data import TextDataModule
    from lit3d.strategies import Parallel3DStrategy

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    gpu = torch.cuda.is_available()
    d_model = args["d_model"]
    config = GPTConfig(
        n_layer=args["n_layer"],
        n_head=d_model // 32,
        n_kv_head=d_model // 64,
        d_model=d_model,
        d_ff=3 * d_model,
        vocab_size=256,
        max_seq_len=args["seq_len"],
        **({"n_expert": args["experts"], "first_dense_layers": 1} if args["experts"] else {}),
    )
    for round_, name in schedule:
        strategy = CONFIGS[name][1]
        L.seed_everything(0, verbose=False)
        model_class = ModelParallelGPT if isinstance(strategy, tuple) else GPT
        muon = {"optimizer": "muon", "muon_ns_dtype": args["muon_ns_dtype"]} if name in MUON_ONLY else {}
        model = model_class(config, warmup_steps=2, optimizer_impl=args["optimizer"], **muon)
        data = TextDataModule(seq_len=args["seq_len"], global_batch_size=args["global_batch_size"])
        if isinstance(strategy, dict):
            strategy = Parallel3DStrategy(**strategy)
        elif isinstance(strategy, tuple):
            strategy = ModelParallelStrategy(data_parallel_size=strategy[1], tensor_parallel_size=strategy[2])
        callbacks = [StepTimer(str(Path(tmp) / f"{round_}-{name}.json"), warmup=args["warmup"])]
        if round_ == 0:  # one step under CommDebugMode, inside the warm-up the timer leaves out
            callbacks.append(CommReport(step=min(2, args["warmup"] - 1), verbose=False))
        trainer = L.Trainer(
            accelerator="gpu" if gpu else "cpu",
            devices=processes,
            strategy=strategy,
            precision="bf16-mixed" if gpu or args["float8"] else "32-true",
            max_steps=args["steps"] + args["warmup"] + 1,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        trainer.fit(model, data)
        if round_ == 0 and trainer.is_global_zero and callbacks[1].measured is not None:
            report = {"measured": callbacks[1].measured, "planned": callbacks[1].planned}
            (Path(tmp) / f"0-{name}-comm.json").write_text(json.dumps(report))
        if round_ == 0 and trainer.is_global_zero and args.get("profiles") and isinstance(strategy, Parallel3DStrategy):
            from lit3d.planner.calibrate import cluster_of
            from lit3d.planner.run import plan_of_run

            planned = plan_of_run(trainer.strategy, cluster_of(args["profiles"][processes], processes))
            (Path(tmp) / f"0-{name}-predicted.json").write_text(json.dumps(planned.step_time_s))


class ModelParallelGPT(GPT):
    """The GPT parallelised as Lightning's `ModelParallelStrategy` expects: by the module, in `configure_model`,
    over the strategy's mesh: the same tensor-parallel plan (PyTorch's DTensor styles), then FSDP2 per block."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        super().configure_model()
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp_mesh.size() > 1:
            apply_tensor_parallel(self.model, self.tensor_parallel_plan, tp_mesh, sequence_parallel=False)
            self.model.tie_weights()
        if dp_mesh.size() > 1:
            for block in self.model.blocks.values():
                fully_shard(block, mesh=dp_mesh)
            fully_shard(self.model, mesh=dp_mesh)

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        with loss_parallel_scope():  # the vocabulary-parallel loss's backward
            loss.backward(*args, **kwargs)


if __name__ == "__main__":
    main()
