"""The commands beside LightningCLI's: ``lit3d plan``, ``export``, ``convert`` and ``generate``; each is a function
whose arguments and docstring are its command line (jsonargparse)."""

from __future__ import annotations

from typing import Literal

from lit3d.config import PRESETS
from lit3d.hardware import GPUS


def export(ckpt_path: str, output: str, dtype: str = "float32") -> None:
    """Write a lit3d checkpoint (saved by any layout) as a HuggingFace Llama folder.

    Args:
        ckpt_path: The checkpoint folder (e.g. ``runs/tiny/version_0/checkpoints/epoch=0-step=600.ckpt``).
        output: The folder to write: ``config.json`` (with the source's BOS/EOS ids), ``model.safetensors``, the
            source's ``generation_config.json`` and the run's tokenizer, loadable with
            ``transformers.AutoModelForCausalLM.from_pretrained(output)`` and ``AutoTokenizer``.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
    """
    import torch

    from lit3d.hf import export_checkpoint

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} is not one of float32, bfloat16, float16")
    folder, notes = export_checkpoint(ckpt_path, output, getattr(torch, dtype))
    print("\n".join([f"wrote {folder}: {', '.join(sorted(p.name for p in folder.iterdir()))}", *notes]))


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
    expert_parallel_size: int | None = None,
    context_parallel_size: int | None = None,
    sequence_parallel: bool = True,
    activation_checkpointing: bool | Literal["full", "selective"] | None = None,
    pipeline_schedule: str | None = None,
    virtual_pipeline_size: int | None = None,
    islands: int = 1,
    inter_island_bandwidth: float = 1.0,
    inter_island_latency: float = 10.0,
    sync_every: int = 500,
    outer_fragments: int = 1,
    outer_reduce_dtype: str = "float32",
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
        model: A preset name ({presets}) or a model YAML file.
        nodes: Number of nodes.
        gpus_per_node: GPUs in each node.
        gpu: A known device ({gpus}) whose memory, peak and link speeds are the defaults of the next four
            arguments (``CPU``: one core of a CPU rehearsal per rank).
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
        expert_parallel_size: Fix EP (an MoE model: ranks borrowed from DP that split the experts); searched
            when not given.
        context_parallel_size: Fix CP (ranks that split every sequence; between DP and TP); searched when not
            given for sequences of 16k tokens and more (1 otherwise).
        sequence_parallel: Sequence parallelism between TP regions.
        activation_checkpointing: Recompute activations: ``true``/``full`` (each block's input only) or
            ``selective`` (keeps matmul, attention and collective outputs); searched (off or full) when not given,
            off for a fixed layout.
        pipeline_schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zero_bubble``, ``zbv`` or ``dualpipev``;
            when not given, each layout runs the schedule and micro-batch count with the shortest step that fits
            (``--json``: ``pipeline_schedule`` and every candidate's bubble in ``schedule_candidates``).
        virtual_pipeline_size: Model chunks per pipeline rank of ``interleaved_1f1b`` and ``zero_bubble``
            (``zbv`` and ``dualpipev`` run 2).
        islands: DiLoCo: the GPUs split into this many islands (datacenters) of the same layout, which meet only at
            the outer step; prints the time per outer step and what it saves against synchronous DP.
        inter_island_bandwidth: GB/s per GPU between islands.
        inter_island_latency: Milliseconds per hop between islands.
        sync_every: Inner steps per outer step with islands (DiLoCo's paper: 500).
        outer_fragments: Streaming DiLoCo: fragments synced at staggered steps (the same bytes, fewer at a time).
        outer_reduce_dtype: What the pseudo-gradients travel in: ``float32`` or ``bfloat16``.
        top: How many layouts a search prints.
        json: Print one JSON object instead of text.
        verify: Build the real model on the meta device, parallelise it for the layout in a fake process group
            of the full world size, and compare its per-rank parameter counts with the analytic ones.
        map: Draw the rank map to this ``.svg``, ``.png`` or ``.html`` file: of the layout, or of a search's best
            three one above the other, with each rank's number and memory and each layout's traffic per link.
    """
    import json as json_module
    from dataclasses import asdict, replace

    from lit3d.config import GPTConfig
    from lit3d.parallel.layout import ZERO_STAGES, Layout, check_islands, check_sizes
    from lit3d.parallel.outer import check_outer_loop
    from lit3d.parallel.schedules import chunks_per_rank
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
    from lit3d.planner.islands import format_islands, versus_synchronous
    from lit3d.planner.pipeline import candidates, choose_schedule
    from lit3d.planner.report import format_verify

    if gpu not in GPUS:
        raise ValueError(f"gpu={gpu!r} is not one of {', '.join(GPUS)}; give gpu_memory, bandwidths and peak_tflops")
    spec, config = GPUS[gpu], GPTConfig.load(model)
    given = lambda value, default: default if value is None else value  # NOTE: 0 is a value (refused), not "unset"
    cluster = Cluster(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        gpu_memory_gb=given(gpu_memory, spec.memory_gb),
        intra_node_gbps=given(intra_node_bandwidth, spec.intra_node_gbps),
        inter_node_gbps=given(inter_node_bandwidth, spec.inter_node_gbps),
        peak_tflops=given(peak_tflops, spec.peak_tflops),
        inter_island_gbps=inter_island_bandwidth,
        inter_island_latency_ms=inter_island_latency,
        device=spec.device,
    )
    training = Training(
        seq_len=given(seq_len, config.max_seq_len),
        micro_batch_size=given(micro_batch_size, 1),
        global_batch_size=global_batch_size,
        precision=precision,
        zero_stage=given(zero_stage, 0),
        sequence_parallel=sequence_parallel,
        activation_checkpointing=activation_checkpointing or False,
        pipeline_schedule=pipeline_schedule or "1f1b",  # (a search weighs them all)
        virtual_pipeline_size=given(virtual_pipeline_size, 1),
        sync_every=sync_every if islands > 1 else 1,
        outer_fragments=outer_fragments,
        outer_reduce_dtype=outer_reduce_dtype,
    )
    if not inter_island_bandwidth > 0 or not inter_island_latency >= 0:
        raise ValueError(f"inter_island_bandwidth={inter_island_bandwidth!r} must be positive and "
                         f"inter_island_latency={inter_island_latency!r} at least 0")  # fmt: skip
    check_inputs(config, cluster, training)
    if pipeline_schedule:
        training.virtual_pipeline_size = chunks_per_rank(pipeline_schedule, virtual_pipeline_size)
    schedules = candidates(pipeline_schedule, virtual_pipeline_size)
    any_schedule = replace(training, pipeline_schedule="gpipe", virtual_pipeline_size=1)  # GPipe runs any m
    check_outer_loop(islands, sync_every, 1.0, 0.0, outer_fragments, outer_reduce_dtype)
    if islands > 1 and cluster.gpus % islands:
        raise ValueError(f"islands={islands} does not divide the {cluster.gpus} GPUs of the cluster")
    sizes = dict(
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        data_parallel_size=data_parallel_size,
        expert_parallel_size=expert_parallel_size,
        context_parallel_size=context_parallel_size,
        num_microbatches=num_microbatches,
        top=top,
    )
    check_sizes(**{name: value for name, value in sizes.items() if value is not None})

    if tensor_parallel_size and pipeline_parallel_size:  # one layout
        tp, pp, cp = tensor_parallel_size, pipeline_parallel_size, context_parallel_size or 1
        if data_parallel_size is None and cluster.gpus % (tp * pp * cp):
            raise ValueError(
                f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} x context_parallel_size={cp} does not "
                f"divide the {cluster.gpus} GPUs of the cluster; give data_parallel_size"
            )
        dp = data_parallel_size or cluster.gpus // (tp * pp * cp)  # every island's replicas
        check_islands(islands, dp, expert_parallel_size or 1, cp)
        layout = Layout(dp=dp // islands, tp=tp, pp=pp, devices_per_node=gpus_per_node, ep=expert_parallel_size or 1,
                        cp=cp, islands=islands)  # fmt: skip
        if dp % layout.ep:
            raise ValueError(f"expert_parallel_size={layout.ep} does not divide data_parallel_size={dp}")
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
        problem = layout_problem(config, cluster, layout, training if pipeline_schedule else any_schedule)
        if problem:
            raise ValueError(problem)
        chosen = None
        if pp > 1 and not pipeline_schedule:
            chosen = choose_schedule(config, cluster, layout, training, schedules, num_microbatches)
        training, result = chosen or (training, estimate(config, cluster, layout, training))
        report, best = result.to_dict(), (layout, training)
        maps = [RankMap(layout, config.name, result, cluster.device)]
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
            data_parallel_size=data_parallel_size // islands if data_parallel_size else None,  # of one island
            expert_parallel_size=expert_parallel_size,
            context_parallel_size=context_parallel_size,
            zero_stages=ZERO_STAGES if zero_stage is None else (zero_stage,),
            checkpointing=(False, True) if activation_checkpointing is None else (activation_checkpointing,),
            islands=islands,
            pipeline_schedules=schedules,
        )
        text = format_search(config, cluster, fitting, dropped, top)
        best = (fitting[0].layout, fitting[0].training) if fitting else None
        maps = [RankMap(c.layout, f"#{i} {config.name}", c.plan, cluster.device) for i, c in enumerate(fitting[:3], 1)]
        report = fitting[0].plan.to_dict() if fitting else {"layout": None}
        report.update(alternatives=[c.plan.to_dict() for c in fitting[1:top]], dropped=dropped)
    report.update(model=config.name, cluster=asdict(cluster), fits=report.get("fits", False))
    if islands > 1 and best:
        layout, chosen = best
        plan_of_best = estimate(config, cluster, layout, chosen)
        report["islands"] = versus_synchronous(config, cluster, layout, chosen, plan_of_best)
        text += "\n" + format_islands(report["islands"])

    if verify and best:
        layout, chosen = best
        counts = verify_counts(
            config,
            layout,
            chosen.zero_stage,
            chosen.sequence_parallel,
            chosen.virtual_pipeline_size if layout.pp > 1 else 1,
            chosen.activation_checkpointing,
            chosen.pipeline_schedule,
        )
        report["verify"] = [
            {"stage": c.stage, "rank": c.rank, "verified": c.verified, "analytic": c.analytic} for c in counts
        ]
        text += "\n" + format_verify(layout, counts)
    if map and best:
        path = RankMap.side_by_side(maps).save(map)
        text += f"\nrank map: {path}"
    print(json_module.dumps(report, indent=2) if json else text)
    if verify and best and not all(c["verified"] == c["analytic"] for c in report["verify"]):
        raise SystemExit("lit3d plan --verify: analytic and verified parameter counts differ")


# NOTE: the lists come from the tables themselves, so a new preset or device shows in `lit3d plan --help` unedited.
if plan.__doc__:  # (None under python -OO)
    presets = ", ".join(f"``{name}``" for name in PRESETS)
    plan.__doc__ = plan.__doc__.replace("{presets}", presets).replace("{gpus}", ", ".join(GPUS))


def convert(ckpt_path: str, output: str) -> None:
    """Write a lit3d checkpoint folder (any layout) as one Lightning checkpoint file.

    The file holds the whole weights, the loop state and the hyper-parameters, and loads on one process under any
    strategy (``lit3d validate|test|predict --ckpt_path FILE``, ``GPT.load_from_checkpoint``, ``GPT(pretrained=)``).
    The optimizer states stay in the folder: to resume training, resume from the folder (any layout).

    Args:
        ckpt_path: The checkpoint folder.
        output: The file to write.
    """
    import torch

    from lit3d.strategies.checkpoint import read_weights

    torch.save(read_weights(ckpt_path), output)
    print(f"wrote {output}")


def generate(
    ckpt_path: str,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    tokenizer: str | None = None,
    devices: int = 1,
    tensor_parallel_size: int = 1,
    accelerator: str = "auto",
) -> None:
    """Print the prompt and its continuation by a trained model.

    Args:
        ckpt_path: A lit3d checkpoint (a folder written by any layout, or a single file) or a local HuggingFace
            Llama folder.
        prompt: The text to continue.
        max_new_tokens: Tokens to generate.
        temperature: Sampling temperature; 0 is greedy.
        top_k: Sample among the k most likely tokens.
        top_p: Sample among the most likely tokens that reach this probability together.
        seed: Seed of the sampling: the same seed gives the same tokens on one device and in any TP layout.
        tokenizer: ``byte`` or a ``tokenizer.json``; default: the run's own (or the HuggingFace folder's).
        devices: Processes (GPUs) to run on; more than one splits the model with tensor parallelism.
        tensor_parallel_size: Ranks that split each layer (``devices`` by default when it is more than one).
        accelerator: ``cpu``, ``gpu`` or ``auto``.
    """
    import lightning as L

    from lit3d.callbacks import PrintCompletions
    from lit3d.data import TextDataModule
    from lit3d.generation import Sampling
    from lit3d.gpt import GPT
    from lit3d.pretrained import tokenizer_of
    from lit3d.strategies import Parallel3DStrategy

    sampling = Sampling(max_new_tokens, temperature, top_k, top_p, seed)
    model = GPT(pretrained=ckpt_path, sampling=sampling)
    data = TextDataModule(tokenizer=tokenizer or tokenizer_of(ckpt_path) or "byte", prompts=[prompt],
                          seq_len=model.config.max_seq_len)  # fmt: skip
    tp = tensor_parallel_size if tensor_parallel_size > 1 else devices
    strategy = Parallel3DStrategy(tensor_parallel_size=tp, zero_stage=0) if devices > 1 else "auto"
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = L.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, callbacks=[PrintCompletions()],
                        **quiet)  # fmt: skip
    trainer.predict(model, datamodule=data, return_predictions=False)


def prepare(
    data_path: str,
    output: str,
    tokenizer: str = "byte",
    text_column: str = "text",
    name: str | None = None,
    split: str = "train",
    num_proc: int = 2,
    shard_tokens: int = 2**27,
) -> None:
    """Tokenize a corpus once, with several processes, into token shards that training reads memory-mapped
    (``TextDataModule(data_path=OUTPUT)``, with the same tokenizer).

    Args:
        data_path: Any source `TextDataModule` reads (files by format, folders, globs, ``hf:NAME``, saved datasets).
        output: A new folder for ``index.json`` and the ``tokens-*.bin`` shards.
        tokenizer: ``byte`` or a ``tokenizer.json`` (or a folder holding one).
        text_column: The column holding the text in tables and datasets.
        name: The configuration of an ``hf:`` dataset.
        split: The split of an ``hf:`` dataset or a saved ``DatasetDict``.
        num_proc: Tokenizing processes.
        shard_tokens: Tokens per shard file.
    """
    import time

    from lit3d.prepared import throughput, write
    from lit3d.sources import check_source, load_documents
    from lit3d.tokenizers import load_tokenizer

    if num_proc < 1 or shard_tokens < 1:
        raise ValueError(f"num_proc={num_proc} and shard_tokens={shard_tokens} must be positive")
    check_source(data_path)
    start = time.perf_counter()
    documents = load_documents(data_path, text_column, name, split)
    index = write(documents, load_tokenizer(tokenizer), tokenizer, output, num_proc, shard_tokens)
    print(throughput(index, documents.data.nbytes, time.perf_counter() - start, num_proc))
