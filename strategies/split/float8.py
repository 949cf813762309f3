"""FP8 training of the transformer blocks' linears, with torchao's float8 (`torchao.float8`).

Each linear of a block (q, k, v, o, gate, up, down) becomes torchao's ``Float8Linear``: its matmuls run in FP8 with
dynamic scales (``tensorwise``: one scale per tensor, e4m3 forward and e5m2 for the output gradient; ``rowwise``: a
scale per row, e4m3 throughout, as torchao's recipes say), while its weight, its gradient and the optimizer stay in
high precision, so checkpoints are those of a bf16 run and load in any layout and precision. The embedding, the
output head and an MoE router stay in bf16: their inputs (ids, the last hidden state, routing scores) carry outliers
that an FP8 scale per tensor would crush, and their matmuls are a small share of the FLOPs. MoE experts stay in bf16
(their grouped GEMM has no FP8 path here), and LoRA adapters are refused (a frozen FP8 base is another method).

Applied in the one parallelisation order (`lit3d.strategies.parallelize`) after the pipeline split and before tensor
parallelism, compile and data parallelism: a module swap that keeps every parameter's name, so TP's plan and FSDP2
find the same modules. With ``float8_all_gather`` (tensorwise only), FSDP2 gathers the weights in FP8 (half of bf16's
bytes) and the scales are computed for all weights at once after each optimizer step.

On CPU the FP8 matmuls run as torchao's emulation (``Float8LinearConfig(emulate=True)``): the same casts to FP8, the
same scales and the same bytes sent, then the FP8 operands scaled back and multiplied in fp32, so the numerics and the
bytes are tested without a GPU at about a bf16 step's cost (`benchmarks/fp8_cpu.py`). PyTorch's CPU ``_scaled_mm``
took 640 times a bf16 step in issue 69 (on CPUs with AMX it is oneDNN's FP8 matmul); it still runs where
``LIT3D_FLOAT8_CPU_MATMUL=scaled_mm`` (`CPU_MATMUL`) asks, and rank 0 logs which path a CPU run takes
(`cpu_matmul_line`).

FP8 pays only on large GEMMs: each linear adds casts (a memory-bound pass over each operand) that its faster matmul
must win back. torchao measured where it does on H100 and its filter leaves the smaller linears in bf16
(``torchao.float8._auto_filter_for_recipe``; in torchao 0.18 tensorwise needs more than 1024 outputs or 4096 inputs,
rowwise more than 2048 outputs and 1024 inputs, and more than 4096 outputs or 2048 inputs). Here every block linear
runs in FP8, and `small_gemms_warning` names those under torchao's sizes before the run starts, with the model's
width. Small widths lose accuracy too: a held-out 4-block model of d_model 128 ended 3.8 % above bf16-mixed after 60
steps with tensorwise (rowwise within 3 %).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.nn as nn

from lit3d.models.lora import LoRALinear
from lit3d.parallel.precision import is_float8_linear
from lit3d.planner.tensors import parameter_table

# NOTE: what the two CPU paths compute differently. PyTorch's CPU ``_scaled_mm`` multiplies each FP8 operand by its
# scale's inverse (torchao passes ``1 / scale``), then in fp32, and rounds to bf16; on a CPU with AMX it is oneDNN's
# FP8 matmul instead, slow and not measured here. torchao's emulation divides each operand by its scale, then the same
# in fp32 (`emulates`). Measured on a 2-core AMD EPYC (AVX2: ATen's ``_scaled_mm``), PyTorch 2.13, torchao 0.18, an
# ``mlp.up_proj`` (128 x 384) of the 4-block d_model 128 GPT on 512 fixed tokens under bf16 autocast:
# - rowwise: its scales are powers of 2, so both paths are exact and agree to the bit (output, input and weight
#   gradients); 60 training steps at sequences of 64, batch 8, gave the same losses;
# - tensorwise: ``x / s`` and ``x * (1 / s)`` differ in fp32's last bit, which moves 0.02 % of the results by one
#   bf16 step: max |difference| 4.9e-4 in the output (4.6e-4 of its largest value), 6.1e-5 in the input gradient
#   (3.5e-5), 2.0e-3 in the weight gradient (1.9e-5); over those 60 steps the losses differ by at most 2.6e-4 of
#   their value (the mean of the last 10 by 6.7e-5).
# Both ended within 0.04 % of bf16-mixed's loss there (3.5917 rowwise, 3.5902 tensorwise, 3.5901 bf16-mixed).
CPU_MATMUL = "LIT3D_FLOAT8_CPU_MATMUL"  # the environment variable that chooses `CPU_MATMULS`' path on CPU
CPU_MATMULS = ("emulated", "scaled_mm")  # the first is the default


def apply_float8(network: nn.Module, recipe: str, all_gather: bool = False, emulate: bool = False) -> int:
    """Swap the block linears of ``network`` for torchao's ``Float8Linear`` (``recipe``: `RECIPES`); returns how
    many were swapped. ``emulate``: its matmuls in fp32 on the FP8 operands (`emulates`) rather than ``_scaled_mm``."""
    import dataclasses

    float8 = import_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, enable_fsdp_float8_all_gather=all_gather, emulate=emulate)
    adapted = [name for name, module in network.named_modules() if isinstance(module, LoRALinear)]
    if adapted:
        raise ValueError(f"float8={recipe!r} with LoRA adapters ({adapted[0]}, ...): train the adapters in bf16")
    names = [name for name, _ in network.named_modules() if is_float8_linear(name)]
    float8.convert_to_float8_training(network, config=config, module_filter_fn=lambda _, fqn: fqn in names)
    return len(names)


def cpu_matmul() -> str:
    """Which of `CPU_MATMULS` FP8 matmuls take on CPU: `CPU_MATMUL`'s value, else the first; another value is refused
    naming it."""
    chosen = os.environ.get(CPU_MATMUL) or CPU_MATMULS[0]
    if chosen not in CPU_MATMULS:
        raise ValueError(f"{CPU_MATMUL}={chosen!r} is not one of " + ", ".join(map(repr, CPU_MATMULS)))
    return chosen


def emulates(device_type: str) -> bool:
    """Whether FP8 matmuls on ``device_type`` run as torchao's emulation: on CPU unless `cpu_matmul` says
    ``scaled_mm``; never on an accelerator (its ``_scaled_mm`` is the FP8 kernel)."""
    return device_type == "cpu" and cpu_matmul() == "emulated"


def cpu_matmul_line(recipe: str) -> str:
    """The rank-0 log line of an FP8 run on CPU: which path its matmuls take (`cpu_matmul`)."""
    if cpu_matmul() == "emulated":
        return (
            f"float8={recipe!r} on CPU: FP8 casts and scales as on a GPU, matmuls emulated in fp32 (torchao's "
            f"emulate); {CPU_MATMUL}=scaled_mm runs PyTorch's CPU _scaled_mm instead"
        )
    return (
        f"float8={recipe!r} on CPU: matmuls in PyTorch's CPU _scaled_mm ({CPU_MATMUL}=scaled_mm; where it is "
        "oneDNN's, on CPUs with AMX, a step takes hundreds of times a bf16 step's time)"
    )


def block_gemms(config: Any, tp: int = 1) -> dict[str, tuple[int, int, str]]:
    """The block linears of ``config`` that FP8 runs, by role (``attn.q_proj``): ``(in, out)`` as one TP rank of
    ``tp`` holds them, and a module's name."""

    gemms = {}
    for tensor in parameter_table(config):
        module = tensor.name.removesuffix(".weight")
        if tensor.name.endswith(".weight") and is_float8_linear(module):
            out_features, in_features = (n // tp if dim == tensor.tp_dim else n for dim, n in enumerate(tensor.shape))
            gemms.setdefault(module.split(".", 2)[-1], (in_features, out_features, module))
    return gemms


def small_gemms(recipe: str, config: Any, tp: int = 1) -> dict[str, tuple[int, int]]:
    """The `block_gemms` below the sizes where torchao measured ``recipe`` to pay off (torchao's own filter): role →
    ``(in, out)`` per rank."""
    keeps = getattr(import_float8(), "_auto_filter_for_recipe", None)
    if keeps is None:  # (a torchao without it: nothing to go by)
        return {}
    keeps = keeps(recipe, filter_fqns=[])
    return {
        role: (i, o)
        for role, (i, o, module) in block_gemms(config, tp).items()
        if not keeps(nn.Linear(i, o, bias=False, device="meta"), module)
    }


def small_gemms_warning(recipe: str, config: Any, tp: int = 1) -> str | None:
    """What to say before a run whose FP8 linears are too small for FP8 to pay (`small_gemms`), naming the width."""
    small = small_gemms(recipe, config, tp)
    if not small:
        return None
    shapes = ", ".join(f"{role} {i}x{o}" for role, (i, o) in small.items())
    split = f" per rank at tensor_parallel_size={tp}" if tp > 1 else ""
    below = (
        f"{shapes} (in x out{split}) are below the GEMM sizes where torchao measured {recipe} FP8 to beat bf16 (H100): "
        "their casts cost more than their FP8 matmuls save"
    )
    if len(small) < len(block_gemms(config, tp)):
        return f"float8={recipe!r} with d_model={config.d_model}: {below}"
    return (
        f"float8={recipe!r} with d_model={config.d_model}: every linear FP8 runs is too small for it to pay or to stay "
        f"accurate: {below}, and at such widths FP8 costs accuracy (a 4-block d_model=128 model ended 3.8% above "
        "bf16-mixed after 60 steps with tensorwise). Train this model in bf16-mixed: FP8 pays from about d_model 2048 "
        "(tensorwise) or 4096 (rowwise)"
    )


def precompute_scales(modules: list[nn.Module]) -> None:
    """After an optimizer step under FP8 all-gather: every weight's scale for the next gathers, in one reduction
    (torchao's ``precompute_float8_dynamic_scale_for_fsdp``) rather than one per weight and gather."""
    float8 = import_float8()
    for module in modules:
        float8.precompute_float8_dynamic_scale_for_fsdp(module)


def import_float8() -> Any:
    """``torchao.float8``, or an error that says how to get it."""
    # NOTE: torchao logs a line for each CUDA kernel library it cannot load on a CPU build (they are not used here),
    # and registering its enums warns on this PyTorch: neither is the user's to act on.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError as error:
        raise ImportError("float8 training needs torchao: pip install 'lit3d[fp8]' (or torchao)") from error
    return float8
