"""The dtypes a run holds, computes and communicates in, per axis, from Lightning's ``precision`` and the ZeRO stage.

``bf16-mixed`` as torchtitan and Megatron run it: fp32 master weights and optimizer states, compute in bf16, and
gradients reduced in fp32 (``mixed_precision_reduce="bfloat16"`` halves those bytes, at some accuracy). Where the
master weights live depends on the data-parallel wrapper:

- FSDP2 (ZeRO-2/3, and ZeRO-0 with TP or PP): the fp32 parameter shards are the master weights; its mixed
  precision policy gathers them in bf16 for compute.
- DDP (ZeRO-0, data parallel only) and a run without data parallelism: the fp32 parameters themselves, which
  autocast casts to bf16 in every forward (keeping each bf16 copy for backward).
- ZeRO-1 (`keeps_master_weights`): bf16 parameters, and the fp32 master weights of each rank's slice in the sharded
  optimizer state (Megatron's distributed optimizer); the bf16 gradients are reduce-scattered in the reduce dtype
  and the updated slices all-gathered in bf16.

The planner counts what each holds from the same rule (`lit3d.planner.estimate.held_precision`).
"""

from __future__ import annotations

REDUCE_DTYPE_NAMES = ("float32", "bfloat16")  # `mixed_precision_reduce`'s choices


def check_reduce_dtype(mixed_precision_reduce: str) -> None:
    if mixed_precision_reduce not in REDUCE_DTYPE_NAMES:
        raise ValueError(
            f"mixed_precision_reduce={mixed_precision_reduce!r} is not one of "
            + ", ".join(map(repr, REDUCE_DTYPE_NAMES))
        )


def is_bf16_mixed(precision: str) -> bool:
    return str(precision) == "bf16-mixed"


def keeps_master_weights(precision: str, zero_stage: int, replicas: int) -> bool:
    """Whether the model's parameters are bf16 and the optimizer steps fp32 master copies of this rank's slices:
    ZeRO-1 under bf16-mixed with data-parallel replicas (`lit3d.strategies.zero1.LocalShardOptimizer`)."""
    return is_bf16_mixed(precision) and zero_stage == 1 and replicas > 1
