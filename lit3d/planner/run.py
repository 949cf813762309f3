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


def plan_of_run(strategy: RunningStrategy, cluster: Cluster | None = None) -> Plan | None:
    """Memory and communication of the strategy's run as the planner counts them (with its LoRA adapters, if any);
    None unless it trains a lit3d GPT. ``cluster``: the devices to price its step on (default: H100s, as many as
    the run has ranks).

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
    shares = strategy.parallelism.data_parallel_shares
    if shares is not None:  # uneven replicas: priced as the most loaded one, as if every replica held its share
        micro = max(1, max(shares) // micro_batches)
    precision = str(trainer.precision)
    training = Training(
        seq_len=getattr(data, "seq_len", config.max_seq_len),
        micro_batch_size=micro,
        global_batch_size=micro * replicas * micro_batches,
        accumulate_grad_batches=accumulate,
        precision=precision if precision in PRECISIONS else "32-true",
        lora=getattr(module, "lora", None),
    )
    microbatches = strategy.num_microbatches if pipelined else None
    settings = replace(strategy.parallelism, num_microbatches=microbatches, data_parallel_shares=None).at(layout)
    cluster = cluster or Cluster(nodes=strategy.num_nodes, gpus_per_node=strategy.num_processes)
    return plan(Request(config, cluster, training, settings, EVERY_SETTING)).chosen.plan
