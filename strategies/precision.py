"""The dtypes a run computes and communicates in, per axis, from Lightning's ``precision`` and the ZeRO stage.

``bf16-mixed`` as torchtitan and Megatron run it: fp32 master weights and optimizer states, compute in bf16
(Lightning's autocast), and FSDP2 (ZeRO-2/3, and ZeRO-0 with TP or PP) gathering the parameters in bf16 and
reducing the gradients in fp32 (``mixed_precision_reduce="bfloat16"`` halves those bytes too, at some accuracy).
ZeRO-1 and DDP (ZeRO-0, data parallel only) hold the fp32 parameters themselves: DDP all-reduces the fp32
gradients autocast leaves, and ZeRO-1 reduce-scatters them in the reduce dtype and all-gathers the fp32 slices.
"""

from __future__ import annotations

import torch

REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_reduce_dtype(mixed_precision_reduce: str) -> None:
    if mixed_precision_reduce not in REDUCE_DTYPES:
        raise ValueError(
            f"mixed_precision_reduce={mixed_precision_reduce!r} is not one of {', '.join(map(repr, REDUCE_DTYPES))}"
        )


def is_bf16_mixed(precision: str) -> bool:
    return str(precision) == "bf16-mixed"


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


def describe(precision: str, zero_stage: int, ddp: bool, mixed_precision_reduce: str) -> str:
    """One line for the rank-0 log: what each axis sends, in which dtype."""
    precision = str(precision)
    if not is_bf16_mixed(precision):
        dtype = "bf16" if precision.startswith("bf16") else "fp16" if precision.startswith("16") else "fp32"
        return f"precision {precision}: every axis communicates in {dtype}"
    reduce = "bf16" if mixed_precision_reduce == "bfloat16" else "fp32"
    if ddp:
        dp = "gradients all-reduced in fp32 (DDP)"
    elif zero_stage == 1:
        dp = f"gradients reduce-scattered in {reduce}, updated fp32 slices all-gathered (ZeRO-1)"
    else:
        gathers = "" if zero_stage == 0 else ", parameters gathered in bf16"
        dp = f"gradients reduced in {reduce}{gathers} (FSDP2)"
    return (
        f"precision bf16-mixed: fp32 master weights and optimizer states, bf16 compute; dp: {dp}; tp and pp: "
        "activations as autocast leaves them (bf16 matmul outputs)"
    )
