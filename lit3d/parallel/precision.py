"""The dtypes a run holds, computes and communicates in, per axis, from Lightning's ``precision`` and the ZeRO stage.

``bf16-mixed`` as torchtitan and Megatron run it: fp32 master weights and optimizer states, compute in bf16, and
gradients reduced in fp32 (``mixed_precision_reduce="bfloat16"`` halves those bytes, at some accuracy). Where the
master weights live depends on the data-parallel wrapper:

- FSDP2 (ZeRO-2/3, and ZeRO-0 with TP or PP): the fp32 parameter shards are the master weights; its mixed
  precision policy gathers them in bf16 for compute.
- DDP (ZeRO-0, data parallel only) and a run without data parallelism: the fp32 parameters themselves, which
  autocast casts to bf16 in every forward (keeping each bf16 copy for backward).
- ZeRO-1 (`lit3d.parallel.zero.ZeroPolicy.keeps_master_weights`): bf16 parameters, and the fp32 master weights
  of each rank's slice in the sharded optimizer state (Megatron's distributed optimizer); the bf16 gradients are
  reduce-scattered in the reduce dtype and the updated slices all-gathered in bf16.

The planner counts what each holds from the same rule (`lit3d.planner.estimate.held_precision`).
"""

from __future__ import annotations

from typing import Any

REDUCE_DTYPE_NAMES = ("float32", "bfloat16")  # `mixed_precision_reduce`'s choices


def check_reduce_dtype(mixed_precision_reduce: str) -> None:
    if mixed_precision_reduce not in REDUCE_DTYPE_NAMES:
        raise ValueError(
            f"mixed_precision_reduce={mixed_precision_reduce!r} is not one of "
            + ", ".join(map(repr, REDUCE_DTYPE_NAMES))
        )


def is_bf16_mixed(precision: str) -> bool:
    return str(precision) == "bf16-mixed"


FLOAT8_PRECISIONS = ("bf16-mixed", "bf16-true")  # FP8 matmuls inside a bf16 run (`lit3d.strategies.split.float8`)
FLOAT8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_float8_linear(module: str) -> bool:
    """Whether the module named ``module`` (relative to the network) is a block linear that FP8 runs: not the
    embedding, the head, an MoE router or its experts (`lit3d.strategies.split.float8` says why)."""
    if not module.startswith("blocks.") or ".router." in module or ".experts" in module:
        return False
    return module.rsplit(".", 1)[-1] in FLOAT8_LINEARS


def check_float8(
    float8: str | None, precision: str | None, config: Any = None, tp: int = 1, lora: bool = False
) -> None:
    """FP8 needs a bf16 run, and each rank's part of every block linear in multiples of 16 (``torch._scaled_mm``);
    an MoE model's experts stay in bf16; LoRA's frozen base is not cast (refused). Refused naming the values."""
    if float8 is None:
        return
    if lora:
        raise ValueError(f"float8={float8!r} with LoRA adapters: train the adapters in bf16")
    if precision is not None and str(precision) not in FLOAT8_PRECISIONS:
        raise ValueError(
            f"float8={float8!r} with precision={precision!r}: FP8 matmuls run inside a bf16 run, "
            f"use precision in {FLOAT8_PRECISIONS}"
        )
    if config is None:
        return
    split = {
        "n_head x head_dim": config.n_head * config.head_dim,
        "n_kv_head x head_dim": config.n_kv_head * config.head_dim,
        **({"d_ff": config.d_ff} if config.moe_layers < config.n_layer else {}),
    }
    whole = {"d_model": config.d_model, "n_shared_experts x d_ff_expert": config.n_shared_experts * config.d_ff_expert}
    odd = {name: width for name, width in split.items() if width % (16 * tp)}
    odd |= {name: width for name, width in whole.items() if width % 16}
    if odd:
        raise ValueError(
            f"float8={float8!r}: {odd} not multiples of 16 (those TP splits: of 16 x "
            f"tensor_parallel_size={tp}); FP8 matmuls need every rank's weight dims in them"
        )
