"""The dtypes a run computes and communicates in, as torch dtypes and FSDP2's policy, and the rank-0 log line that
says so; the rules of what a run holds are `lit3d.parallel.precision`'s."""

from __future__ import annotations

import torch

from lit3d.parallel.precision import REDUCE_DTYPE_NAMES, is_bf16_mixed, keeps_master_weights

REDUCE_DTYPES = dict(zip(REDUCE_DTYPE_NAMES, (torch.float32, torch.bfloat16)))


def uses_ddp(zero_stage: int, data_parallel_only: bool, precision: str, mixed_precision_reduce: str) -> bool:
    """ZeRO-0 of a network that is only data parallel is DDP, unless bf16-mixed asks for bf16 reduction (which
    FSDP2's ``replicate`` does)."""
    return zero_stage == 0 and data_parallel_only and reduce_dtype(precision, mixed_precision_reduce) is None


def reduce_dtype(precision: str, mixed_precision_reduce: str) -> torch.dtype | None:
    """The dtype gradients travel in when it differs from theirs: bf16 under bf16-mixed if asked; else None."""
    bf16_reduce = is_bf16_mixed(precision) and mixed_precision_reduce == "bfloat16"
    return torch.bfloat16 if bf16_reduce else None


def mixed_precision_policy(precision: str, mixed_precision_reduce: str) -> object | None:
    """FSDP2's policy: bf16 parameters for compute and the chosen reduce dtype under bf16-mixed; else none."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not is_bf16_mixed(precision):
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=REDUCE_DTYPES[mixed_precision_reduce])


def describe(precision: str, zero_stage: int, ddp: bool, mixed_precision_reduce: str, replicas: int) -> str:
    """One line for the rank-0 log: what each rank holds and what each axis sends, in which dtype."""
    precision = str(precision)
    if not is_bf16_mixed(precision):
        dtype = "bf16" if precision.startswith("bf16") else "fp16" if precision.startswith("16") else "fp32"
        return f"precision {precision}: every axis communicates in {dtype}"
    reduce = "bf16" if mixed_precision_reduce == "bfloat16" else "fp32"
    if ddp:
        held = "fp32 parameters (autocast keeps a bf16 copy of each weight for backward)"
        dp = "gradients all-reduced in fp32 (DDP)"
    elif replicas == 1:  # nothing to shard over: the optimizer steps the fp32 parameters themselves
        held, dp = "fp32 parameters", "no data parallelism"
    elif keeps_master_weights(precision, zero_stage, replicas):
        held = "bf16 parameters, fp32 master weights in the optimizer slices"
        dp = f"gradients reduce-scattered in {reduce}, updated slices all-gathered in bf16 (ZeRO-1)"
    else:
        held = "fp32 parameters" + ("" if zero_stage == 0 else " sharded") + ", cast to bf16 by FSDP2"
        gathers = "" if zero_stage == 0 else ", parameters gathered in bf16"
        dp = f"gradients reduced in {reduce}{gathers} (FSDP2)"
    return (
        f"precision bf16-mixed: {held}, fp32 optimizer states, bf16 compute; dp: {dp}; tp and pp: "
        "activations as autocast leaves them (bf16 matmul outputs)"
    )
