"""The planner's estimate of a running fit: what `Parallel3DStrategy` logs at the start and `CommReport` compares.

It is the search's own estimate (`estimate`) of the run's layout and settings: one table of what each precision
holds (`lit3d.planner.estimate.held_precision`) serves both, so `lit3d plan` plans what the run holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lit3d.config import GPTConfig
from lit3d.planner.estimate import PRECISIONS, Cluster, Plan, Training, estimate

if TYPE_CHECKING:
    from lit3d.strategies import Parallel3DStrategy


def plan_of_run(strategy: Parallel3DStrategy) -> Plan | None:
    """Memory and communication of the strategy's run as the planner counts them; None unless it trains a lit3d GPT.

    The micro-batch is what one replica computes at once: the global batch over data-parallel replicas, gradient
    accumulation's micro-steps and, with a pipeline, the schedule's micro-batches (each micro-step runs a schedule).
    """
    module, layout = strategy.lightning_module, strategy.layout
    config = getattr(module, "config", None)
    if not isinstance(config, GPTConfig):
        return None
    trainer = module.trainer
    data = getattr(trainer, "datamodule", None)
    accumulate = trainer.accumulate_grad_batches
    micro_batches = accumulate * (strategy.num_microbatches if layout.pp > 1 else 1)  # per replica and step
    replicas = layout.data_replicas  # every island's
    global_batch = getattr(data, "global_batch_size", replicas * micro_batches)
    micro = max(1, global_batch // (replicas * micro_batches))
    precision = str(trainer.precision)
    training = Training(
        seq_len=getattr(data, "seq_len", config.max_seq_len),
        micro_batch_size=micro,
        global_batch_size=micro * replicas * micro_batches,
        accumulate_grad_batches=accumulate,
        precision=precision if precision in PRECISIONS else "32-true",
        mixed_precision_reduce=strategy.mixed_precision_reduce,
        zero_stage=strategy.zero_stage,
        sequence_parallel=strategy.sequence_parallel,
        activation_checkpointing=strategy.activation_checkpointing,
        pipeline_schedule=strategy.pipeline_schedule,
        virtual_pipeline_size=strategy.virtual_pipeline_size,
        sync_every=strategy.sync_every,
        outer_reduce_dtype=strategy.outer_reduce_dtype,
        outer_fragments=strategy.outer_fragments,
    )
    cluster = Cluster(nodes=strategy.num_nodes, gpus_per_node=strategy.num_processes)
    return estimate(config, cluster, layout, training)
