"""Activation checkpointing: what each decoder block keeps for backward.

``full``: only the block's input; backward reruns the whole block (about a third more compute).
``selective``: the outputs of the matmuls, of attention and of the tensor-parallel collectives; backward reruns
only the cheap elementwise work (norms, rotary, SiLU, products). Most of the memory those take, for a few
percent of compute, and no collective is run twice.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from lit3d.parallel.settings import check_recompute


def _saved_ops() -> set:
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    ops = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_mm.default,
        c10d.all_reduce.default,
        c10d.all_gather_into_tensor.default,
        c10d.reduce_scatter_tensor.default,
        c10d.all_to_all_single.default,  # expert parallelism's token dispatch and combine
    }
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    return ops


def _keep_matmuls_and_collectives(saved: set, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(blocks: list[nn.Module], activation_checkpointing: bool | str) -> None:
    """Checkpoint each of ``blocks`` in place (``True`` or ``"full"``, ``"selective"``); names are unchanged."""
    from torch.distributed._composable import checkpoint
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    check_recompute(activation_checkpointing)
    for block in blocks:
        if activation_checkpointing in (True, "full"):
            checkpoint(block)
        elif activation_checkpointing == "selective":
            policy = partial(_keep_matmuls_and_collectives, _saved_ops())
            checkpoint(block, context_fn=partial(create_selective_checkpoint_contexts, policy))
