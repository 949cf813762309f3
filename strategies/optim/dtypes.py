"""The dtypes a run computes and communicates in, as torch dtypes and FSDP2's policy, and the rank-0 log line that
says so; the rules of what a run holds are `lit3d.parallel.precision`'s."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from typing_extensions import override

from lit3d.parallel.layout import Layout
from lit3d.parallel.precision import REDUCE_DTYPE_NAMES, is_bf16_mixed
from lit3d.parallel.settings import Parallelism
from lit3d.parallel.zero import ZeroPolicy

REDUCE_DTYPES = dict(zip(REDUCE_DTYPE_NAMES, (torch.float32, torch.bfloat16)))


def uses_ddp(zero: ZeroPolicy, data_parallel_only: bool, precision: str, mixed_precision_reduce: str) -> bool:
    """ZeRO-0 of a network that is only data parallel is DDP, unless bf16-mixed asks for bf16 reduction (which
    FSDP2's ``replicate`` does)."""
    return zero.all_reduces and data_parallel_only and reduce_dtype(precision, mixed_precision_reduce) is None


def ddp_runs(parallelism: Parallelism, layout: Layout, precision: str) -> bool:
    """`uses_ddp` for a run: DDP takes no DTensor, so only a network that is data parallel alone."""
    data_parallel_only = layout.tp == layout.pp == layout.ep == 1
    zero = ZeroPolicy.of(parallelism, layout)
    return uses_ddp(zero, data_parallel_only, precision, parallelism.mixed_precision_reduce)


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


def describe(parallelism: Parallelism, layout: Layout, precision: str) -> str:
    """One line for the rank-0 log: what each rank holds and what each axis sends, in which dtype."""
    zero, reduce = ZeroPolicy.of(parallelism, layout), parallelism.mixed_precision_reduce
    return describe_dtypes(precision, zero, ddp_runs(parallelism, layout, precision), reduce)


def describe_dtypes(precision: str, zero: ZeroPolicy, ddp: bool, mixed_precision_reduce: str) -> str:
    """`describe` from its parts."""
    precision = str(precision)
    if not is_bf16_mixed(precision):
        dtype = "bf16" if precision.startswith("bf16") else "fp16" if precision.startswith("16") else "fp32"
        return f"precision {precision}: every axis communicates in {dtype}"
    reduce = "bf16" if mixed_precision_reduce == "bfloat16" else "fp32"
    if ddp:
        held = "fp32 parameters (autocast keeps a bf16 copy of each weight for backward)"
        dp = "gradients all-reduced in fp32 (DDP)"
    elif zero.replicas == 1:  # nothing to shard over: the optimizer steps the fp32 parameters themselves
        held, dp = "fp32 parameters", "no data parallelism"
    elif zero.keeps_master_weights(precision):
        held = "bf16 parameters, fp32 master weights in the optimizer slices"
        dp = f"gradients reduce-scattered in {reduce}, updated slices all-gathered in bf16 (ZeRO-1)"
    else:
        held = "fp32 parameters" + ("" if zero.all_reduces else " sharded") + ", cast to bf16 by FSDP2"
        gathers = "" if zero.all_reduces else ", parameters gathered in bf16"
        dp = f"gradients reduced in {reduce}{gathers} (FSDP2)"
    return (
        f"precision bf16-mixed: {held}, fp32 optimizer states, bf16 compute; dp: {dp}; tp and pp: "
        "activations as autocast leaves them (bf16 matmul outputs)"
    )


# NOTE: Lightning's precision plugins clip by the norm over this process's parameters; a split model needs the norm
# over every shard and stage. The strategy turns the plugin Lightning chose into lit3d's subclass of the same class
# (`clipping_split_model`) and gives it its ``clip`` (`Parallel3DStrategy.precision_plugin`). A plugin of one's own
# subclasses one of these.
ClipByNorm = Callable[[Any, float], None]


class SplitModelPrecision(Precision):
    """``precision="32-true"``, clipping by the norm of the split model (``clip``, set by the strategy)."""

    clip: ClipByNorm | None = None

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self.clip(optimizer, clip_val) if self.clip else super().clip_grad_by_norm(optimizer, clip_val)


class SplitModelMixedPrecision(MixedPrecision):
    """``precision="bf16-mixed"`` (autocast), clipping by the norm of the split model (``clip``)."""

    clip: ClipByNorm | None = None

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self.clip(optimizer, clip_val) if self.clip else super().clip_grad_by_norm(optimizer, clip_val)


class SplitModelHalfPrecision(HalfPrecision):
    """``precision="bf16-true"`` or ``"16-true"``, clipping by the norm of the split model (``clip``)."""

    clip: ClipByNorm | None = None

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self.clip(optimizer, clip_val) if self.clip else super().clip_grad_by_norm(optimizer, clip_val)


SPLIT_MODEL_PLUGINS = (SplitModelPrecision, SplitModelMixedPrecision, SplitModelHalfPrecision)


def clipping_split_model(plugin: Precision | None, clip: ClipByNorm) -> Precision | None:
    """Lightning's chosen ``plugin`` as the lit3d class that clips over the split model with ``clip``; a plugin of
    another kind is refused (its clipping would see this process's shards only)."""
    if plugin is None:
        return None
    if isinstance(plugin, SPLIT_MODEL_PLUGINS):
        converted = plugin
    elif type(plugin) is Precision:
        converted = SplitModelPrecision()
    elif type(plugin) is MixedPrecision:
        converted = SplitModelMixedPrecision(plugin.precision, plugin.device, plugin.scaler)
    elif type(plugin) is HalfPrecision:
        converted = SplitModelHalfPrecision(plugin.precision)
    else:
        raise TypeError(
            f"Parallel3DStrategy clips gradients by the norm of the whole split model, which the precision plugin "
            f"{type(plugin).__name__} cannot: use a precision setting ('32-true', 'bf16-mixed', 'bf16-true'), or "
            "subclass lit3d.strategies.optim.dtypes.SplitModelPrecision, SplitModelMixedPrecision or "
            "SplitModelHalfPrecision"
        )
    converted.clip = clip
    return converted
