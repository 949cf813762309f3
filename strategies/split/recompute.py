"""Activation checkpointing: what each decoder block keeps for backward.

``full``: only the block's input; backward reruns the whole block (about a third more compute).
``selective``: the outputs of the matmuls, of attention and of the tensor-parallel collectives; backward reruns
only the cheap elementwise work (norms, rotary, SiLU, products). Most of the memory those take, for a few
percent of compute, and no collective is run twice.

Either way the recomputed forward sees what the forward saw: it runs with the forward's arguments, the batch's context
among them (packed documents, LoRA dropout's rows: `lit3d.models.batch_context`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache, partial
from typing import Any

import torch
import torch.nn as nn

from lit3d.parallel.layout import Layout
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
    """Checkpoint each of ``blocks`` in place (``True`` or ``"full"``, ``"selective"``); names are unchanged.

    NOTE: by module hooks, as PyTorch's composable ``checkpoint``, but the recomputation runs the block's ``forward``
    alone, not the block's call (as torchtitan's checkpoint wrapper, without a wrapper module): the hooks data
    parallelism puts on the block (FSDP2's unshard and input casts, which run before the checkpointed region) are not
    run again inside it, where selective recompute refuses what the forward did not run (PyTorch 2.13: "...
    encountered during backward but not found in storage"; bf16-mixed at ZeRO 0, 2 and 3).
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    check_recompute(activation_checkpointing)
    for block in blocks:
        if activation_checkpointing in (True, "full"):
            options = {}
        elif activation_checkpointing == "selective":
            policy = partial(_keep_matmuls_and_collectives, _saved_ops())
            options = {"context_fn": partial(create_selective_checkpoint_contexts, policy)}
        else:
            continue
        region = _Region(options)
        block.register_forward_pre_hook(region.enter, with_kwargs=True)
        block.register_forward_hook(region.exit, prepend=True, always_call=True)


class _Region:
    """The checkpointed region of one block's forward, opened by its pre-hook and closed by its hook."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options, self.run = options, None

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        from torch.utils.checkpoint import _checkpoint_without_reentrant_generator as checkpointed

        # PyTorch's own region (composable `checkpoint`'s), given its arguments before the inputs by position; the
        # recomputation runs ``module.forward`` with this call's ``args`` and ``kwargs``
        given = {"preserve_rng_state": True, **self.options}
        options = [given.get(name, default) for name, default in _options(checkpointed)]
        self.run = checkpointed(module.forward, *options, *args, **kwargs)
        next(self.run)

    def exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        run, self.run = self.run, None
        if run is not None:
            next(run, None)


@cache
def _options(checkpointed: Callable) -> list[tuple[str, Any]]:
    """The names and defaults of the arguments between the function and its inputs (they differ across versions)."""
    named = [p for p in inspect.signature(checkpointed).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    return [(p.name, p.default) for p in named[1:]]


def check_recompute_composes(activation_checkpointing: bool | str, zero_stage: int, layout: Layout) -> None:
    """Refuse what recompute cannot run with, naming the settings (asked before any rank starts)."""
    edp = layout.dp // layout.ep * layout.cp  # the ranks that hold the same experts
    if activation_checkpointing == "selective" and zero_stage == 0 and layout.ep > 1 and edp > 1:
        # NOTE: measured (PyTorch 2.13): a `replicate` unit inside the recomputed block runs other hooks in the
        # recomputation than in the forward ("FSDP::root_pre_forward"), which selective recompute refuses in step 0.
        raise ValueError(
            f"activation_checkpointing='selective' with expert_parallel_size={layout.ep} at zero_stage=0: each MoE "
            f"layer's experts are then a data-parallel unit of their own inside the recomputed block (replicated over "
            f"{edp} ranks), whose hooks PyTorch's selective recompute cannot run again; use "
            "activation_checkpointing='full', or zero_stage=1, 2 or 3"
        )
    if activation_checkpointing == "selective" and zero_stage >= 2 and layout.ep > 1 and edp > 1:
        # NOTE: measured (PyTorch 2.13, benchmarks/combinations.py, seed 1): DP4 x PP2 x EP2 at ZeRO-2 or 3 stops in
        # step 0, the last stage's backward finding no gradient for its loss; DP4 x TP2 x EP2 at ZeRO-2 (no pipeline)
        # stops in its first recompute, whose FSDP2 hooks of the experts' unit run other profiler ranges than their
        # forward did. At ZeRO-1, under full recompute or with the experts whole on every rank (edp 1) it trains
        # exactly. Not root-caused yet: refused.
        raise ValueError(
            f"activation_checkpointing='selective' with expert_parallel_size={layout.ep} (pipeline_parallel_size="
            f"{layout.pp}) at zero_stage={zero_stage}: each MoE layer's experts are a sharded data-parallel unit of "
            f"their own inside the recomputed block (over {edp} ranks), which selective recompute does not run again "
            "as its forward ran; use activation_checkpointing='full', or zero_stage=1"
        )
