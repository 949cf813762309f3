"""What a ZeRO stage means, in one place: `ZeroPolicy`, asked by the strategy (what FSDP2 wraps, when it reshards,
what the micro-steps of an accumulation window send: `lit3d.strategies.split.data_parallel`), the optimizer steps
(ZeRO-1's slices: `lit3d.strategies.optim.steps`), the precision plugins (master weights) and the planner's memory and
traffic.

==========  ========================  ===========================  ==============  ==========================
zero_stage  parameters                gradients                    optimizer       built from
==========  ========================  ===========================  ==============  ==========================
0           replicated                all-reduced                  replicated      DDP, or FSDP2's replicate
1           replicated                reduce-scattered at the      sliced (1/R)    lit3d's slices, no wrapper
                                      step; slices all-gathered
2           sharded, gathered once    reduce-scattered             sharded (1/R)   FSDP2, kept after forward
3           sharded, gathered twice   reduce-scattered             sharded (1/R)   FSDP2, resharded after
                                                                                   forward
==========  ========================  ===========================  ==============  ==========================

``R`` is the replicas: the ranks that hold the same weights (``dp × cp``); over one replica nothing is sharded. With
HSDP's shard groups (``data_parallel_shard_size``), ``R`` is a group's ranks, and the ``groups`` replicate one another:
after a group's reduce-scatter they all-reduce the shards' gradients, once per step. With
gradient accumulation, ZeRO-2/3 reduce-scatter at every micro-step and sum the shards, unless
``accumulate_unsharded`` (one reduction at the last micro-step, the gradients held whole in between); ZeRO-0 and 1
send nothing before the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit3d.parallel.precision import is_bf16_mixed


@dataclass(frozen=True)
class ZeroPolicy:
    """One run's ZeRO: its ``stage``, over ``replicas`` ranks, accumulating ``accumulate_unsharded`` or not."""

    stage: int
    replicas: int = 1
    accumulate_unsharded: bool = False
    groups: int = 1  # HSDP: shard groups that replicate one another

    @classmethod
    def of(cls, parallelism: Any, layout: Any) -> ZeroPolicy:
        """The policy of a `lit3d.parallel.Parallelism` on a `lit3d.parallel.layout.Layout`."""
        return cls(parallelism.zero_stage, layout.shard_ranks, parallelism.accumulate_unsharded, layout.dp_replicate)

    @property
    def slices_optimizer(self) -> bool:
        """ZeRO-1: each replica steps its slice of every tensor (lit3d's own, no wrapper), then gathers them."""
        return self.stage == 1 and self.replicas > 1

    @property
    def shards_parameters(self) -> bool:
        """ZeRO-2/3: FSDP2 wraps the blocks, and parameters, gradients and states live as shards."""
        return self.stage >= 2

    @property
    def sharded_over_replicas(self) -> bool:
        """`shards_parameters` over more than one replica: a rank holds 1/R of each sharded tensor."""
        return self.shards_parameters and self.replicas > 1

    @property
    def reshards_after_forward(self) -> bool:
        """ZeRO-3: a block's parameters are freed after its forward and gathered again for its backward."""
        return self.stage == 3

    @property
    def keeps_gathered_across_micro_steps(self) -> bool:
        """ZeRO-2: the parameters gathered at the first micro-step stay gathered until the window's last."""
        return self.stage == 2

    @property
    def reduces_every_micro_step(self) -> bool:
        """Whether each micro-step of an accumulation window reduce-scatters its gradients (summed as shards)."""
        return self.shards_parameters and not self.accumulate_unsharded

    @property
    def hybrid(self) -> bool:
        """HSDP: ZeRO over each of several shard groups, which all-reduce their shards' gradients."""
        return self.groups > 1

    @property
    def all_reduces(self) -> bool:
        """ZeRO-0: gradients all-reduced whole (DDP's bytes, or FSDP2's replicate)."""
        return self.stage == 0

    def keeps_master_weights(self, precision: str) -> bool:
        """Whether the model's parameters are bf16 and the optimizer steps fp32 master copies of this rank's slices:
        ZeRO-1 under bf16-mixed with replicas (`lit3d.strategies.optim.zero1.LocalShardOptimizer`)."""
        return is_bf16_mixed(precision) and self.slices_optimizer
