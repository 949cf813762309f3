"""Tensor parallelism: a model's plan (module name → role) turned into DTensor parallel styles.

Megatron's pattern: a column-parallel linear splits its output features, the row-parallel linear after it
splits its input features and sums the partial results, so each attention or MLP region costs one all-reduce
forward and one backward. With sequence parallelism the activations between regions stay split along the
sequence, and that all-reduce becomes an all-gather before the region and a reduce-scatter after it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lit3d.models.block import compute_dtype
from lit3d.parallel.sharding import ROLES


def parallel_styles(sequence_parallel: bool) -> dict[str, ParallelStyle | None]:
    """The DTensor style for each role; None means the module stays as it is (replicated)."""
    # Between TP regions the residual stream is either replicated or split along the sequence (dim 1).
    between = Shard(1) if sequence_parallel else Replicate()
    return {
        "colwise": SplitColumns(),
        "rowwise": SplitRows(output_layouts=between),
        # NOTE: the region's input becomes one replicated DTensor shared by its column-parallel linears (q, k, v
        # or gate, up), so backward sums their partial input gradients and reduces them once per region.
        "tp_region": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        # A module every TP rank runs whole on the whole sequence (an MoE layer: experts are split by expert
        # parallelism instead): plain tensors in, its output back to the residual stream's layout. Every rank's
        # input gradient is already the whole one, so nothing is summed over TP in backward.
        "replicated_region": PrepareModuleInputOutput(
            input_layouts=(between,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(between,),
            use_local_output=True,
        ),
        # A small module inside a region that every rank computes whole on the region's replicated input (latent
        # attention's down-projections and norms): its weights replicated DTensors, so that it takes that input.
        "replicated": ReplicateWeights(),
        "norm": NormOnShards() if sequence_parallel else None,
        # a norm whose output joins the residual stream (Gemma's after attention and the MLP): a plain tensor again
        "residual_norm": NormOnShards(use_local_output=True) if sequence_parallel else None,
        # q and k as [batch, seq, heads, head_dim], split by heads (dim 2): the weight's gradient summed over TP.
        "head_norm": NormOnShards(sequence_dim=2, use_local_output=True),
        "head_split": SplitHeads(),
        "vocab_embedding": VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=between),
        # NOTE: logits stay a vocabulary-sharded DTensor so the loss never gathers them (loss_parallel).
        "vocab_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    }


class NormOnShards(SequenceParallel):
    """Sequence parallel for a norm: it runs on each rank's share of the sequence, its weight replicated.

    NOTE: PyTorch's `SequenceParallel` replicates the weight as a new parameter that trains whatever the old one did;
    this keeps ``requires_grad``, so a frozen norm (a LoRA run's) stays frozen."""

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for p_name, param in list(module.named_parameters()):
            replicated = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
            module.register_parameter(p_name, nn.Parameter(replicated, requires_grad=param.requires_grad))


class ReplicateWeights(ParallelStyle):
    """Every parameter of the module as a replicated DTensor; its input and output are left as they come (inside a TP
    region: replicated DTensors, whose gradients DTensor sums over TP where they are partial)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute(module, device_mesh, self.src_data_rank, {})
        return module


class SplitHeads(ParallelStyle):
    """A module's weight with one value per query head (gpt-oss's sinks, `lit3d.models.block.Sinks`) split along the
    heads as the column-parallel q projection splits them; the attention reads its rank's share."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute(module, device_mesh, self.src_data_rank, {"weight": Shard(0)})
        return module


class SplitColumns(ColwiseParallel):
    """Column parallel: the weight split along its output features; a LoRA adapter's ``B`` along them too and its
    ``A`` whole, so ``x Aᵀ`` is every rank's and ``(x Aᵀ) Bᵀ`` is split as the base output is (`lit3d.models.lora`)."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        placements = {"weight": Shard(0), "bias": Shard(0), "lora_b": Shard(0), "lora_a": Replicate()}
        _distribute(module, device_mesh, self.src_data_rank, placements)


class SplitRows(RowwiseParallel):
    """Row parallel: the weight split along its input features; a LoRA adapter's ``A`` along them too and its ``B``
    whole, so ``x Aᵀ`` and then ``(x Aᵀ) Bᵀ`` are partial sums like the base output's, summed by its one reduction."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        placements = {"weight": Shard(1), "bias": Replicate(), "lora_a": Shard(1), "lora_b": Replicate()}
        _distribute(module, device_mesh, self.src_data_rank, placements)


def _distribute(module: nn.Module, mesh: DeviceMesh, source: int | None, placements: dict[str, Any]) -> None:
    """Replace each parameter of ``module`` by its DTensor, placed as ``placements`` names it (else whole)."""
    for name, param in list(module.named_parameters(recurse=False)):
        placement = placements.get(name, Replicate())
        tensor = distribute_tensor(param, mesh, [placement], src_data_rank=source)
        module.register_parameter(name, nn.Parameter(tensor, requires_grad=param.requires_grad))


class VocabParallelEmbedding(RowwiseParallel):
    """An embedding split by vocabulary rows: each rank looks up the ids in its rows and the partial outputs are
    summed over TP. Under autocast (bf16-mixed) they are summed in the compute dtype: the lookup is no autocast op,
    so with fp32 weights (DDP, ZeRO-1) the reduction would move fp32."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        # NOTE: cast the local partial sums: DTensor would reduce a partial tensor before casting it.
        local = compute_dtype(outputs.to_local())
        if local.dtype != outputs.dtype:
            outputs = DTensor.from_local(local, outputs.device_mesh, outputs.placements, run_check=False)
        return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def apply_tensor_parallel(
    network: nn.Module, plan: dict[str, str], tp_mesh: DeviceMesh, sequence_parallel: bool
) -> None:
    """Parallelise ``network`` in place over ``tp_mesh`` following ``plan`` (name pattern → role)."""
    unknown = sorted(set(plan.values()) - set(ROLES))
    if unknown:
        raise ValueError(f"unknown tensor-parallel roles {unknown}; known roles: {ROLES}")
    styles = parallel_styles(sequence_parallel)
    present = {name for name, _ in network.named_modules()}
    module_plan = {
        pattern: styles[role]
        for pattern, role in plan.items()
        if styles[role] is not None and _matches_any(pattern, present)  # a pipeline stage lacks some modules
    }
    parallelize_module(network, tp_mesh, module_plan)


class KeepSequenceShard:
    """Under SP, a TP region (attention or MLP) gathers its input from the sequence shards, and autograd would keep
    that gathered ``[b, s, h]`` copy for the column-parallel linears' weight gradients: t times the shard, more at
    t = 8 than the rest of the layer. This keeps the shard instead and gathers it again when backward needs it, as
    Megatron does: one more all-gather per region in backward, 1/t of the memory (Korthikanti et al. 2022, Eq. 4).

    NOTE: saved-tensor hooks, entered for the region's forward: a tensor autograd saves that lives in the gathered
    input's storage (the input itself or a view) is packed as the shard and rebuilt, exactly, on unpacking.
    """

    def __init__(self, region: nn.Module) -> None:
        self.shard: torch.Tensor | None = None
        self.gathered: int | None = None
        self.hooks: list = []
        region.register_forward_pre_hook(self._before_gather, prepend=True)  # before PrepareModuleInput's hook
        region.register_forward_pre_hook(self._after_gather)  # after it
        region.register_forward_hook(self._done, always_call=True)

    def _before_gather(self, module: nn.Module, args: tuple) -> None:
        self.shard = args[0]

    def _after_gather(self, module: nn.Module, args: tuple) -> None:
        gathered, shard = args[0], self.shard
        if isinstance(shard, DTensor):
            shard = shard._local_tensor if shard.placements == (Shard(1),) else None
        if not torch.is_grad_enabled() or not isinstance(gathered, DTensor) or shard is None:
            return
        self.gathered = gathered._local_tensor.untyped_storage().data_ptr()
        source, shard = _Shard(gathered.device_mesh), shard.detach()
        # Hooks entered around this region (e.g. a caller's) keep seeing what is saved: the shard, not the copy.
        outer_pack, outer_unpack = _outer_hooks() or (lambda t: t, lambda t: t)

        def pack(tensor: torch.Tensor) -> Any:
            local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
            if local.untyped_storage().data_ptr() != self.gathered:
                return outer_pack(tensor)
            view = (local.size(), local.stride(), local.storage_offset())
            meta = (tensor.placements, tensor.shape, tensor.stride()) if isinstance(tensor, DTensor) else None
            source.saved += 1
            return _Regather(source, outer_pack(shard), view, meta)

        def unpack(saved: Any) -> torch.Tensor:
            if not isinstance(saved, _Regather):
                return outer_unpack(saved)
            return saved.rebuild(outer_unpack(saved.shard))

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        self.hooks.append(hooks)

    def _done(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.hooks:
            self.hooks.pop().__exit__(None, None, None)
        self.shard = self.gathered = None


class _Shard:
    """A region's gathered input as backward sees it: gathered again from the shard for the first tensor unpacked,
    kept until the last of the tensors saved from it is (q, k and v each saved a view: one all-gather serves all)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh, self.saved, self.gathered = mesh, 0, None

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        if self.gathered is None:
            with torch.no_grad():
                whole = DTensor.from_local(shard, self.mesh, [Shard(1)]).redistribute(placements=[Replicate()])
            self.gathered = whole.to_local()
        gathered, self.saved = self.gathered, self.saved - 1
        if self.saved <= 0:  # the last tensor saved from it: let the copy go with backward's use of it
            self.gathered = None
        return gathered


class _Regather:
    """A saved tensor that lived in a region's gathered input, kept as the sequence shard."""

    def __init__(self, source: _Shard, shard: Any, view: tuple, meta: tuple | None) -> None:
        self.source, self.shard, self.view, self.meta = source, shard, view, meta

    def rebuild(self, shard: torch.Tensor) -> torch.Tensor:
        """The saved tensor again: the shard all-gathered along the sequence, in the saved view's layout."""
        local = self.source.gather(shard).as_strided(*self.view)
        if self.meta is None:
            return local
        placements, shape, stride = self.meta
        return DTensor.from_local(local, self.source.mesh, placements, run_check=False, shape=shape, stride=stride)


def _outer_hooks() -> tuple | None:
    """The saved-tensor hooks in force before ours (PyTorch has no public way to ask)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def keep_sequence_shards(network: nn.Module, plan: dict[str, str]) -> None:
    """`KeepSequenceShard` on every TP region of ``network`` (call after `apply_tensor_parallel` with SP)."""
    patterns = [pattern for pattern, role in plan.items() if role == "tp_region"]
    for name, module in network.named_modules():
        if any(_matches_any(pattern, {name}) for pattern in patterns):
            KeepSequenceShard(module)


def lay_out_grads_like_params(parameters: Iterable[torch.Tensor]) -> None:
    """Give each DTensor gradient its parameter's layout (a local slice: no communication).

    NOTE: DTensor's embedding backward returns the vocabulary-parallel embedding's gradient replicated, the
    whole table on every TP rank, where the optimizer needs only this rank's rows. (FSDP2 does the same for
    the parameters it manages, so this matters when there is no data-parallel wrapper.)
    """
    for param in parameters:
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(placements=param.placements)


def check_plan(network: nn.Module, plan: dict[str, str]) -> None:
    """Every pattern of the plan must name modules of the (whole, unsplit) network: a typo would silently
    leave layers unsplit."""
    present = {name for name, _ in network.named_modules()}
    unmatched = [pattern for pattern in plan if not _matches_any(pattern, present)]
    if unmatched:
        raise ValueError(f"tensor_parallel_plan names modules the network does not have: {unmatched}")


def _matches_any(pattern: str, names: set[str]) -> bool:
    from fnmatch import fnmatchcase

    return any(fnmatchcase(name, pattern) for name in names)
