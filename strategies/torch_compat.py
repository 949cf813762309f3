"""What differs between the PyTorch releases lit3d supports (2.11 to the newest 2.x), bridged in one place.

Each entry names the API, the releases that have it, and what the older ones get instead. The code elsewhere calls
these and never asks for a version; each entry detects the feature itself, so a release that back-ports or renames
one keeps working.

=======================  ===============  ==============================================================
entry                    PyTorch          what it bridges
=======================  ===============  ==============================================================
`all_gather_single`      2.13+            2.11/2.12: ``all_gather_into_tensor`` (2.13 renamed it)
`reduce_scatter_single`  2.13+            2.11/2.12: ``reduce_scatter_tensor`` (2.13 renamed it)
`ddp_no_buffer_sync`     2.13+            2.11/2.12: ``broadcast_buffers=False`` (2.13: ``forward_sync_buffers``)
`pipeline_stage`         all              2.11/2.12: the warm-up of a V's fold
`rowwise_float8_on_cpu`  2.13+            2.11/2.12: the CPU FP8 matmul takes one scale per tensor (GPUs: both)
=======================  ===============  ==============================================================

Not an API difference, so not here: 2.11 and 2.12 refuse a pipeline stage's input whose strides differ from the
traced ones, so the pipeline hands its stages contiguous inputs (`lit3d.strategies.pipelining.step`).
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

import torch
import torch.distributed as dist


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``input`` of every rank of ``group``, end to end in ``output`` (one collective)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """The sum over ``group`` of ``input``, each rank receiving its slice of it in ``output`` (one collective)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, group=group, async_op=async_op)


def ddp_no_buffer_sync() -> dict[str, bool]:
    """DDP's (and the composable ``replicate``'s) keyword for "never broadcast the buffers at forward".

    NOTE: 2.13 deprecates ``broadcast_buffers`` for ``forward_sync_buffers``; ``broadcast_buffers=False`` also skips
    the buffers at the initial sync, which lit3d turns off anyway (``init_sync=False``), so both mean the same here.
    """
    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


@cache
def pipeline_stage() -> type:
    """PyTorch's `PipelineStage` as 2.13 has it (imported late: the module takes seconds to import): the first step's
    warm-up of the links to the neighbouring stages leaves out a neighbour on this very rank (the fold of a V-shaped
    schedule, whose two stages hand over in memory): 2.11 and 2.12 send to themselves there, which gloo refuses ("Pair
    is not connected"). (2.13 warms up a `PipelineStage` another way.)
    """
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        def _get_init_p2p_neighbors_ops(self) -> list:
            return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    return Stage


@cache
def rowwise_float8_on_cpu() -> bool:
    """Whether PyTorch's CPU FP8 matmul (``torch._scaled_mm``) takes a scale per row, as ``float8="rowwise"`` needs
    where a CPU run chooses it (``LIT3D_FLOAT8_CPU_MATMUL=scaled_mm``; torchao's default emulation needs no kernel):
    2.13 and later; 2.11 and 2.12 take one scale per tensor only (CUDA's takes both in every supported release)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True
