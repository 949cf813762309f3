"""lit3d's command line: ``lit3d fit|validate|test|predict --config ...`` (LightningCLI), ``lit3d plan`` and
``lit3d export``.

Installed as the ``lit3d`` console script; ``python cli.py ...`` from a checkout does the same.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningCLI

import lit3d.strategies  # registers "3d" and makes `Parallel3DStrategy` resolvable by its short name
from lit3d.callbacks import Throughput
from lit3d.gpt import GPT, check_model_fits_data


class Lit3DCLI(LightningCLI):
    """LightningCLI with lit3d's defaults: the tiny GPT on the embedded corpus, a Rich progress bar when
    interactive, and the `Throughput` callback (tokens/s, MFU) unless the config has one."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.set_defaults(
            {
                "model": {"class_path": "lit3d.GPT"},
                "data": {"class_path": "lit3d.data.TextDataModule"},
            }
        )

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        configured = config.get("callbacks") or []  # one callback or a list, as `Trainer(callbacks=...)` takes
        given = [*([configured] if isinstance(configured, Callback) else configured), *callbacks]
        if (
            sys.stdout.isatty()
            and config.get("enable_progress_bar") is not False
            and not any(isinstance(c, ProgressBar) for c in given)
        ):
            callbacks = [*callbacks, RichProgressBar()]
        if not any(isinstance(c, Throughput) for c in given):  # tokens/s and MFU for every run
            callbacks = [*callbacks, Throughput()]
        return super()._instantiate_trainer(config, callbacks)

    def _check_model_and_data(self) -> None:
        # Before the trainer launches any process: a mismatch fails here, once, with a clear message.
        if isinstance(self.model, GPT) and self.datamodule is not None:
            check_model_fits_data(self.model.config, self.datamodule)

    before_fit = before_validate = before_test = before_predict = _check_model_and_data


def _resolve_lit3d_01_strategy_path() -> None:
    """lit3d 0.1's configs name the strategy ``strategies.Parallel3DStrategy``, from the top-level module it used to
    install. Unless some other ``strategies`` module is importable, that name means `lit3d.strategies` in this
    command's process, so those configs keep working. (From a checkout, the repository's ``strategies/`` folder is
    that package itself.)"""
    if "strategies" not in sys.modules and importlib.util.find_spec("strategies") is None:
        sys.modules["strategies"] = lit3d.strategies


def export(ckpt_path: str, output: str, dtype: str = "float32") -> None:
    """Write a lit3d checkpoint (saved by any layout) as a HuggingFace Llama folder.

    Args:
        ckpt_path: The checkpoint folder (e.g. ``runs/tiny/version_0/checkpoints/epoch=0-step=600.ckpt``).
        output: The folder to write: ``config.json`` and ``model.safetensors`` (and ``tokenizer.json`` when the
            run used one), loadable with ``transformers.AutoModelForCausalLM.from_pretrained(output)``.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
    """
    import torch

    from lit3d.hf import export_checkpoint

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} is not one of float32, bfloat16, float16")
    folder = export_checkpoint(ckpt_path, output, getattr(torch, dtype))
    print(f"wrote {folder}: {', '.join(sorted(p.name for p in folder.iterdir()))}")


def plan(
    model: str = "llama-8b",
    nodes: int = 1,
    gpus_per_node: int = 8,
    gpu: str = "H100",
    gpu_memory: float | None = None,
    intra_node_bandwidth: float | None = None,
    inter_node_bandwidth: float | None = None,
    peak_tflops: float | None = None,
    seq_len: int | None = None,
    micro_batch_size: int | None = None,
    global_batch_size: int = 1024,
    num_microbatches: int | None = None,
    precision: str = "bf16-mixed",
    zero_stage: int | None = None,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
    data_parallel_size: int | None = None,
    sequence_parallel: bool = True,
    activation_checkpointing: bool | None = None,
    pipeline_schedule: str = "1f1b",
    virtual_pipeline_size: int = 1,
    top: int = 5,
    json: bool = False,
    verify: bool = False,
    map: str | None = None,
) -> None:
    """Plan a layout: memory per GPU, communication, pipeline bubble and step time, before renting a GPU.

    With ``tensor_parallel_size`` and ``pipeline_parallel_size`` given, reports that layout; otherwise
    searches every valid layout of the cluster (sizes given are kept), drops those that do not fit and
    prints the fastest.

    Args:
        model: A preset name (``tiny``, ``125m``, ``1b``, ``llama-8b``, ``llama-70b``, ``llama-405b``,
            ``gpt3-175b``) or a model YAML file.
        nodes: Number of nodes.
        gpus_per_node: GPUs in each node.
        gpu: A known GPU (H100, H200, A100, A100 40GB, L40S, A10G) whose memory, peak and link speeds are
            the defaults of the next four arguments.
        gpu_memory: Memory of one GPU, GB.
        intra_node_bandwidth: GB/s per GPU and direction inside a node (NVLink).
        inter_node_bandwidth: GB/s per GPU between nodes (InfiniBand).
        peak_tflops: Dense bf16 peak of one GPU, TFLOP/s.
        seq_len: Tokens per sequence (default: the model's max_seq_len).
        micro_batch_size: Sequences per micro-batch (default 1, or global_batch_size / (dp x num_microbatches)).
        global_batch_size: Sequences per optimizer step over all replicas.
        num_microbatches: Micro-batches per replica per step (needs a fixed layout).
        precision: ``bf16-mixed`` (2 + 2 + 12 bytes per parameter), ``bf16-true`` or ``32-true``.
        zero_stage: 0-3; searched when not given (1 for a fixed layout).
        tensor_parallel_size: Fix TP.
        pipeline_parallel_size: Fix PP.
        data_parallel_size: Fix DP (default: what TP and PP leave of the cluster).
        sequence_parallel: Sequence parallelism between TP regions.
        activation_checkpointing: Recompute activations; searched when not given (off for a fixed layout).
        pipeline_schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` or ``zero_bubble``.
        virtual_pipeline_size: Model chunks per pipeline rank (interleaved schedules).
        top: How many layouts a search prints.
        json: Print one JSON object instead of text.
        verify: Build the real model on the meta device, parallelise it for the layout in a fake process group
            of the full world size, and compare its per-rank parameter counts with the analytic ones.
        map: Draw the rank map of the layout to this ``.svg``, ``.png`` or ``.html`` file.
    """
    import json as json_module
    from dataclasses import asdict

    from lit3d.config import GPTConfig
    from lit3d.hardware import GPUS
    from lit3d.planner import (
        Cluster,
        RankMap,
        Training,
        check_inputs,
        estimate,
        format_plan,
        format_search,
        layout_problem,
        search,
    )
    from lit3d.planner import verify as verify_counts
    from lit3d.strategies.layout import ZERO_STAGES, Layout, check_sizes

    if gpu not in GPUS:
        raise ValueError(f"gpu={gpu!r} is not one of {', '.join(GPUS)}; give gpu_memory, bandwidths and peak_tflops")
    spec = GPUS[gpu]
    config = GPTConfig.load(model)
    cluster = Cluster(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        gpu_memory_gb=gpu_memory or spec.memory_gb,
        intra_node_gbps=intra_node_bandwidth or spec.intra_node_gbps,
        inter_node_gbps=inter_node_bandwidth or spec.inter_node_gbps,
        peak_tflops=peak_tflops or spec.peak_tflops,
    )
    training = Training(
        seq_len=seq_len or config.max_seq_len,
        micro_batch_size=micro_batch_size or 1,
        global_batch_size=global_batch_size,
        precision=precision,
        zero_stage=zero_stage or 0,
        sequence_parallel=sequence_parallel,
        activation_checkpointing=bool(activation_checkpointing),
        pipeline_schedule=pipeline_schedule,
        virtual_pipeline_size=virtual_pipeline_size,
    )
    check_inputs(config, cluster, training)
    sizes = dict(
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        data_parallel_size=data_parallel_size,
        num_microbatches=num_microbatches,
        top=top,
    )
    check_sizes(**{name: value for name, value in sizes.items() if value is not None})

    if tensor_parallel_size and pipeline_parallel_size:  # one layout
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        if data_parallel_size is None and cluster.gpus % (tp * pp):
            raise ValueError(
                f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} does not divide the "
                f"{cluster.gpus} GPUs of the cluster; give data_parallel_size"
            )
        dp = data_parallel_size or cluster.gpus // (tp * pp)
        layout = Layout(dp=dp, tp=tp, pp=pp, devices_per_node=gpus_per_node)
        if zero_stage is None:
            training.zero_stage = 1
        if num_microbatches is not None:
            if global_batch_size % (dp * num_microbatches):
                raise ValueError(
                    f"global_batch_size={global_batch_size} is not divisible by data_parallel_size={dp} "
                    f"x num_microbatches={num_microbatches}"
                )
            derived = global_batch_size // (dp * num_microbatches)
            if micro_batch_size not in (None, derived):
                raise ValueError(
                    f"micro_batch_size={micro_batch_size} disagrees with global_batch_size="
                    f"{global_batch_size} / (data_parallel_size={dp} x num_microbatches={num_microbatches})"
                    f" = {derived}"
                )
            training.micro_batch_size = derived
        problem = layout_problem(config, cluster, layout, training)
        if problem:
            raise ValueError(problem)
        result = estimate(config, cluster, layout, training)
        report, best = result.to_dict(), (layout, training)
        text = format_plan(config, cluster, layout, training, result)
    else:
        if num_microbatches is not None:
            raise ValueError(
                f"num_microbatches={num_microbatches} needs a fixed layout (tensor_parallel_size and "
                "pipeline_parallel_size); give micro_batch_size for a search"
            )
        fitting, dropped = search(
            config,
            cluster,
            training,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            zero_stages=ZERO_STAGES if zero_stage is None else (zero_stage,),
            checkpointing=(False, True) if activation_checkpointing is None else (activation_checkpointing,),
        )
        text = format_search(config, cluster, fitting, dropped, top)
        best = (fitting[0].layout, fitting[0].training) if fitting else None
        report = fitting[0].plan.to_dict() if fitting else {"layout": None}
        report.update(alternatives=[c.plan.to_dict() for c in fitting[1:top]], dropped=dropped)
    report.update(model=config.name, cluster=asdict(cluster), fits=report.get("fits", False))

    if verify and best:
        layout, chosen = best
        counts = verify_counts(
            config,
            layout,
            chosen.zero_stage,
            chosen.sequence_parallel,
            chosen.virtual_pipeline_size if layout.pp > 1 else 1,
            chosen.activation_checkpointing,
        )
        report["verify"] = [
            {"stage": c.stage, "rank": c.rank, "verified": c.verified, "analytic": c.analytic} for c in counts
        ]
        text += (
            f"\nverify: the real parallelisation on {layout.world_size} simulated ranks (meta device, fake "
            "process group), parameters on rank (d=0, t=0, p):"
        )
        for c in counts:
            text += (
                f"\n  stage {c.stage:>3} rank {c.rank:>6}: {c.verified:>14,} verified  {c.analytic:>14,} analytic"
                f"  {'match' if c.matches else 'MISMATCH'}"
            )
    if map and best:
        path = RankMap(best[0], title=f"{config.name}").save(map)
        text += f"\nrank map: {path}"
    print(json_module.dumps(report, indent=2) if json else text)
    if verify and best and not all(c["verified"] == c["analytic"] for c in report["verify"]):
        raise SystemExit("lit3d plan --verify: analytic and verified parameter counts differ")


FLAGS = ("--json", "--verify", "--sequence_parallel", "--activation_checkpointing")


def _bare_flags_true(argv: list[str]) -> list[str]:
    """``--json`` alone means ``--json=true`` (jsonargparse wants a value for every bool)."""
    out = []
    for i, arg in enumerate(argv):
        bare = arg in FLAGS and (i + 1 == len(argv) or argv[i + 1].startswith("--"))
        out.append(f"{arg}=true" if bare else arg)
    return out


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv[:1] in (["export"], ["plan"]):
        from jsonargparse import CLI

        command = export if argv[0] == "export" else plan
        try:
            CLI(command, args=_bare_flags_true(argv[1:]), as_positional=False)
        except ValueError as error:  # bad input: one line naming the value, no traceback
            raise SystemExit(f"lit3d {argv[0]}: error: {error}") from None
        return
    make_cli(args)


def make_cli(args: list[str] | None = None, run: bool = True) -> Lit3DCLI:
    """`Lit3DCLI` for any LightningModule and LightningDataModule (``class_path`` + ``init_args``); lit3d's are
    the defaults."""
    _resolve_lit3d_01_strategy_path()
    return Lit3DCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


if __name__ == "__main__":
    main()
