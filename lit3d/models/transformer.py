"""The Llama-style decoder as a plain `nn.Module`, with its tensor-parallel plan declared as data
(`lit3d.models.tp_plan`).

Layout (parameter names are the same in every parallel layout, which keeps checkpoints portable)::

    embed                       token embedding           (absent on pipeline stages that do not start the model)
    blocks.{0..N-1}.attn_norm   RMSNorm
    blocks.{i}.attn.{q,k,v,o}_proj   (latent attention: q_proj or q_a_proj, q_a_layernorm, q_b_proj;
                                 kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; o_proj)
    blocks.{i}.mlp_norm         RMSNorm
    blocks.{i}.mlp.{gate,up,down}_proj
    norm                        final RMSNorm             (absent on stages that do not end the model)
    head                        LM head                   (absent likewise; shares `embed.weight` when tied)

A pipeline stage keeps a subset of `blocks` (still keyed by their global index) and drops what it does not own;
`forward` passes through whatever is absent.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit3d.models.attention import causal_attention
from lit3d.models.batch_context import NO_CONTEXT, BatchContext
from lit3d.models.config import GPTConfig
from lit3d.models.latent_attention import LatentAttention
from lit3d.models.lora import LoRA, init_adapter, linear, project
from lit3d.models.lora_dropout import name_dropouts
from lit3d.models.mlp import MLP
from lit3d.models.moe import MoE
from lit3d.models.ring_attention import ContextParallel, ring_attention
from lit3d.models.rotary import Rope, apply_rotary, position_tables, rotary_tables

__all__ = ["Transformer", "apply_rotary", "rotary_tables"]  # (the rotary helpers are read from here too)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig, lora: LoRA | None = None) -> None:
        super().__init__()
        self.config = config
        hd, d, bias = config.head_dim, config.d_model, config.qkv_bias  # Qwen2: biased q, k and v
        self.q_proj = linear(d, config.n_head * hd, lora, "attn.q_proj", bias)
        self.k_proj = linear(d, config.n_kv_head * hd, lora, "attn.k_proj", bias)
        self.v_proj = linear(d, config.n_kv_head * hd, lora, "attn.v_proj", bias)
        self.o_proj = linear(config.n_head * hd, d, lora, "attn.o_proj")
        # Qwen3: each head of q and of k normalised before rotary (under TP, a rank's heads: `lit3d.models.tp_plan`).
        self.q_norm = nn.RMSNorm(hd, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(hd, eps=config.norm_eps) if config.qk_norm else None
        # Under context parallelism, x holds this rank's share of each sequence (`lit3d.models.ring_attention`).
        self.context_parallel: ContextParallel | None = None
        self.rope = Rope.of(config.rope_theta, config.rope_scaling)

    def forward(self, x: torch.Tensor, context: BatchContext = NO_CONTEXT) -> torch.Tensor:
        batch, seq, _ = x.shape
        hd, cp = self.config.head_dim, self.context_parallel
        # NOTE: -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = project(self.q_proj, x, context).view(batch, seq, -1, hd)
        k = project(self.k_proj, x, context).view(batch, seq, -1, hd)
        v = project(self.v_proj, x, context).view(batch, seq, -1, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        docs = context.documents_for(batch, seq)
        cos, sin = position_tables(self.rope, hd, q, docs, cp, self.config.max_seq_len)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cp is None:
            y = causal_attention(q, k, v, self.config.attention, docs)
        else:
            y = ring_attention(q, k, v, cp, docs)
        return project(self.o_proj, y.reshape(batch, seq, -1), context)


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)); the attention is multi-head latent attention
    (`lit3d.models.latent_attention`) where ``config.kv_lora_rank`` is set, and the MLP a Mixture of Experts
    (`lit3d.models.moe.MoE`) in the blocks ``config.is_moe_layer`` names."""

    def __init__(self, config: GPTConfig, index: int = 0, lora: LoRA | None = None) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = LatentAttention(config, lora) if config.kv_lora_rank else Attention(config, lora)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = MoE(config, index, lora) if config.is_moe_layer(index) else MLP(config, lora)

    def forward(self, x: torch.Tensor, context: BatchContext = NO_CONTEXT) -> torch.Tensor:
        # NOTE: the context by keyword: tensor parallelism's input hooks on attn and mlp take one positional argument.
        x = x + self.attn(compute_dtype(self.attn_norm(x)), context=context)
        return x + self.mlp(compute_dtype(self.mlp_norm(x)), context=context)


def compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in autocast's dtype where autocast is on (bf16-mixed): a norm's output, cast once before it enters the
    linears, instead of once by each of them (autocast casts every linear's input anew and keeps each copy for
    backward: three for q, k and v). Under sequence parallelism its gather then moves bf16 too."""
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


class Transformer(nn.Module):
    """Token ids ``[batch, seq]`` → logits ``[batch, seq, padded_vocab_size]`` (padded columns masked to -inf).

    On a pipeline stage without the embedding the input is the hidden state ``[batch, seq, d_model]``, and
    without the head the output is the hidden state. ``context``: what the forward reads of its batch besides the
    tokens (`lit3d.models.batch_context`: packed documents, LoRA dropout's rows).
    """

    def __init__(self, config: GPTConfig, lora: LoRA | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed: nn.Embedding | None = nn.Embedding(config.padded_vocab_size, config.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(config, i, lora) for i in range(config.n_layer)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.head: nn.Linear | None = nn.Linear(config.d_model, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        name_dropouts(self)  # LoRA's dropout masks are keyed by their module's name, the same in every layout
        # Whole tensors by parameter name to start from instead of the seed (`GPT(pretrained=...)`); the next
        # `reset_parameters` copies each rank's shard of them and lets them go.
        self.init_source: dict[str, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, context: BatchContext = NO_CONTEXT) -> torch.Tensor:
        if self.embed is not None:
            x = compute_dtype(self.embed(x))  # bf16-mixed: the residual stream in bf16 whatever holds the weights
        for block in self.blocks.values():
            x = block(x, context=context)
        if self.norm is not None:
            x = compute_dtype(self.norm(x))
        if self.head is not None:
            x = mask_vocab_padding(self.head(x), self.config.vocab_size)
        return x

    def tie_weights(self) -> None:
        """Share the embedding with the head (again: materialising from the meta device unties them)."""
        if self.config.tie_embeddings and self.embed is not None and self.head is not None:
            self.head.weight = self.embed.weight

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Initialise every parameter from ``seed`` and its own name alone.

        Each tensor is drawn in full from a generator seeded by (seed, parameter name) and then cut to this
        rank's shard, so the weights do not depend on the parallel layout, on which blocks a pipeline stage
        kept, or on the order modules were created. ``seed=None`` uses ``torch.initial_seed()`` (what
        ``seed_everything`` set).

        A parameter named in ``init_source`` (pretrained weights) is cut from that whole tensor instead, the same
        way; the source is emptied afterwards, so no rank keeps a second, whole copy of the model.
        """
        from torch.distributed.tensor import DTensor

        seed = torch.initial_seed() if seed is None else seed
        source = self.init_source if self.init_source is not None else {}
        biases = {name: source.pop(name) for name in list(source) if name.endswith("expert_bias")}  # buffers
        for name, param in self.named_parameters():
            if name in source:
                _copy_full(param, _padded(source[name], param.shape).to(param.device))
                continue
            # Values are drawn in fp32 at full size: in place for a plain fp32 parameter, else into a scratch
            # tensor that `_copy_full` casts and, for a DTensor, cuts to this rank's shard.
            in_place = not isinstance(param, DTensor) and param.dtype == torch.float32
            full = param if in_place else torch.empty(param.shape, device=param.device)
            generator = torch.Generator(device=param.device)
            generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            self._init_values(name, full, generator)
            if not in_place:
                _copy_full(param, full)
        source.clear()  # NOTE: also for pipeline chunks, which share this network's attributes
        self.init_source = None
        for name, buffer in self.named_buffers():
            if name.endswith("expert_bias"):  # the sigmoid router's balancing bias: zero, or the pretrained one
                buffer.zero_()
                if name in biases:
                    buffer.copy_(biases[name])

    def moe_layers(self) -> list[nn.Module]:
        """The Mixture-of-Experts feed-forwards of the blocks this network (or pipeline stage) holds."""
        return [block.mlp for block in self.blocks.values() if isinstance(block.mlp, MoE)]

    def _init_values(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if init_adapter(name, tensor, generator):
            return
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
            return
        if name.endswith("proj.bias"):
            tensor.zero_()
            return
        # GPT-2's rule: the projections that write into the residual stream start smaller.
        residual = name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj"))
        scale = 1 / math.sqrt(2 * self.config.n_layer) if residual else 1.0
        tensor.normal_(0.0, self.config.init_std * scale, generator=generator)
        if name in ("embed.weight", "head.weight"):
            tensor[self.config.vocab_size :] = 0  # padding rows stay inert


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Set the logits of the padding rows (ids >= vocab_size) to -inf, so padding never changes a loss.

    Vocabulary-sharded logits (a DTensor) get the mask sharded the same way, so nothing is gathered.
    """
    padded = logits.shape[-1]
    if padded == vocab_size:
        return logits
    mask = torch.zeros(padded, device=logits.device, dtype=logits.dtype)
    mask[vocab_size:] = float("-inf")
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    if isinstance(logits, DTensor):
        last = logits.ndim - 1
        placements = [Shard(0) if p.is_shard(last) else Replicate() for p in logits.placements]
        mask = distribute_tensor(mask, logits.device_mesh, placements, src_data_rank=None)
    return logits + mask


def _padded(tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``shape`` (a vocabulary padded to a multiple), in fp32."""
    if tuple(tensor.shape) == tuple(shape):
        return tensor.float()
    full = torch.zeros(shape)
    full[: tensor.shape[0]] = tensor
    return full


def _copy_full(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full-size tensor into ``target``, which may be a DTensor that holds only a shard of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        # src_data_rank=None: every rank cuts its own shard from its own copy, no communication.
        full = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
    target.copy_(full)


@contextmanager
def loss_parallel_scope() -> Iterator[None]:
    """DTensor's `loss_parallel`, entered only where it is not on already: a pipeline schedule computes the loss inside
    its step, and an inner `loss_parallel` would turn the outer one off as it left.

    NOTE: whether it is on is DTensor's own state (its table of custom operator handlers, which `loss_parallel` fills
    and empties: PyTorch 2.11 to 2.13), so lit3d keeps no copy of it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.distributed.tensor.parallel.loss import customized_loss_ops

    handlers = DTensor._op_dispatcher._custom_op_handlers
    with nullcontext() if all(op in handlers for op in customized_loss_ops) else loss_parallel():
        yield


IGNORED = -100  # a target no loss is taken on (a prompt token, padding)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; with ``scale``, the sum over the targets that are not ``IGNORED``
    times ``scale / targets.numel()`` instead (`lit3d.GPT.loss` says why).

    Logits sharded over the vocabulary (a DTensor from a vocabulary-parallel head) are reduced with
    DTensor's parallel loss, which never gathers the full logits; the caller's backward must then run
    under `loss_parallel_scope` too (the strategy does this).
    """
    count = targets.numel()
    logits, targets = logits.flatten(0, 1).float(), targets.flatten()
    reduction = "mean" if scale is None else "sum"
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(logits, DTensor):
        # The targets go in as a DTensor too: backward saves them, and must not mix plain and distributed tensors.
        targets = DTensor.from_local(targets, logits.device_mesh, [Replicate()] * logits.device_mesh.ndim)
        with loss_parallel_scope():
            loss = F.cross_entropy(logits, targets, ignore_index=IGNORED, reduction=reduction)
        loss = loss.to_local()
    else:
        loss = F.cross_entropy(logits, targets, ignore_index=IGNORED, reduction=reduction)
    return loss if scale is None else loss * (scale / count)
