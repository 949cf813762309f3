"""The planner's estimate of a running fit: what `Parallel3DStrategy` logs at the start and `CommReport` compares.

It is the plan of a request that fixes every setting of the run (`lit3d.planner.plan`), built from the strategy's own
`Parallelism`: the one table of what each precision holds (`lit3d.planner.estimate.held_precision`) and the same
arithmetic serve both, so `lit3d plan` plans what the run holds.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, Protocol

from lit3d.models.config import GPTConfig
from lit3d.parallel.layout import Layout
from lit3d.parallel.settings import Parallelism
from lit3d.planner.estimate import PRECISIONS, Cluster, Plan, Training
from lit3d.planner.request import Request, plan

EVERY_SETTING = frozenset(f.name for f in fields(Parallelism)) | {"micro_batch_size"}


class RunningStrategy(Protocol):
    """What `plan_of_run` reads of the strategy (`lit3d.strategies.Parallel3DStrategy`)."""

    parallelism: Parallelism
    layout: Layout
    num_microbatches: int
    num_nodes: int
    num_processes: int
    lightning_module: Any
    root_device: Any
    global_rank: int


def plan_of_run(
    strategy: RunningStrategy, cluster: Cluster | None = None, fed: tuple[int, int] | None = None
) -> Plan | None:
    """Memory and communication of the strategy's run as the planner counts them (with its LoRA adapters, if any);
    None unless it trains a lit3d GPT. ``cluster``: the devices to price its step on (default: H100s, as many as
    the run has ranks). ``fed``: the sequences and tokens of one micro-step of a replica, as a batch the run is fed
    holds them (`fed_shape`); without it, the data module's ``global_batch_size`` and ``seq_len``, else one sequence of
    the model's ``max_seq_len`` per micro-batch (what a run fed by anything else is re-planned from at its first batch:
    `lit3d.strategies.telemetry.plan_check`).

    Reads the strategy's ``parallelism``, ``layout`` (its sizes resolved), ``num_microbatches``, ``num_nodes`` and
    ``num_processes``, and its module's ``config`` and ``trainer``. The micro-batch is what one replica computes at
    once: the global batch over data-parallel replicas, gradient accumulation's micro-steps and, with a pipeline, the
    schedule's micro-batches (each micro-step runs a schedule).
    """
    module, layout = strategy.lightning_module, strategy.layout
    config = getattr(module, "config", None)
    if not isinstance(config, GPTConfig):
        return None
    trainer = module.trainer
    data = getattr(trainer, "datamodule", None)
    accumulate = trainer.accumulate_grad_batches
    pipelined = layout.pp > 1
    micro_batches = accumulate * (strategy.num_microbatches if pipelined else 1)  # per replica and step
    replicas = layout.data_replicas  # every island's
    global_batch = getattr(data, "global_batch_size", replicas * micro_batches)
    micro = max(1, global_batch // (replicas * micro_batches))
    seq_len = getattr(data, "seq_len", config.max_seq_len)
    if fed is not None:  # a micro-step's sequences, cut into the schedule's micro-batches by a pipeline
        micro, seq_len = max(1, fed[0] // (strategy.num_microbatches if pipelined else 1)), fed[1]
    shares = strategy.parallelism.data_parallel_shares
    if shares is not None:  # uneven replicas: priced as the most loaded one, as if every replica held its share
        micro = max(1, max(shares) // micro_batches)
    precision = str(trainer.precision)
    training = Training(
        seq_len=seq_len,
        micro_batch_size=micro,
        global_batch_size=micro * replicas * micro_batches,
        accumulate_grad_batches=accumulate,
        precision=precision if precision in PRECISIONS else "32-true",
        lora=getattr(module, "lora", None),
        optimizer=getattr(module, "optimizer_name", "adamw"),
    )
    microbatches = strategy.num_microbatches if pipelined else None
    settings = replace(strategy.parallelism, num_microbatches=microbatches, data_parallel_shares=None).at(layout)
    cluster = cluster or Cluster(nodes=strategy.num_nodes, gpus_per_node=strategy.num_processes)
    return plan(Request(config, cluster, training, settings, EVERY_SETTING)).chosen.plan


def fed_shape(module: Any, batch: Any) -> tuple[int, int] | None:
    """The sequences and tokens (targets) of ``batch``, one micro-step of a replica, for a module whose batches
    `inputs_and_targets` reads (a lit3d GPT's); None for another's."""
    read = getattr(module, "inputs_and_targets", None)
    if not isinstance(getattr(module, "config", None), GPTConfig) or read is None:
        return None
    targets = read(batch)[1]
    return (int(targets.shape[0]), int(targets.shape[1])) if getattr(targets, "ndim", 0) == 2 else None


def data_says(strategy: RunningStrategy, fed: tuple[int, int]) -> str:
    """Where the data module's ``global_batch_size`` and ``seq_len`` disagree with the batches ``fed``: what it says,
    for rank 0's line ('' where they agree, or it says neither)."""
    module, layout = strategy.lightning_module, strategy.layout
    data = getattr(module.trainer, "datamodule", None)
    batch, seq_len = getattr(data, "global_batch_size", None), getattr(data, "seq_len", None)
    if batch is None and seq_len is None:
        return ""
    steps = layout.data_replicas * module.trainer.accumulate_grad_batches
    if strategy.parallelism.data_parallel_shares is None and (batch, seq_len) == (fed[0] * steps, fed[1]):
        return ""
    if strategy.parallelism.data_parallel_shares is not None and seq_len == fed[1]:
        return ""
    return f" (the data module says global_batch_size={batch}, seq_len={seq_len})"
