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
    mtp.{k}.{enorm,hnorm,eh_proj,norm}, mtp.{k}.block.*
                                multi-token prediction's depths (`lit3d.models.mtp`), if the model has them

A pipeline stage keeps a subset of `blocks` (still keyed by their global index) and drops what it does not own;
`forward` passes through whatever is absent.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn

from lit3d.models.batch_context import NO_CONTEXT, BatchContext
from lit3d.models.block import Block, compute_dtype
from lit3d.models.config import GPTConfig
from lit3d.models.lora import LoRA, init_adapter
from lit3d.models.lora_dropout import name_dropouts
from lit3d.models.loss import IGNORED, AddToObjective, cross_entropy, loss_parallel_scope
from lit3d.models.moe import MoE
from lit3d.models.mtp import MultiTokenPrediction
from lit3d.models.norms import rms_norm
from lit3d.models.rotary import apply_rotary, rotary_tables

# (read from here too: the block, the loss and the rotary helpers)
__all__ = ["IGNORED", "Block", "Transformer", "apply_rotary", "compute_dtype", "cross_entropy", "loss_parallel_scope",
           "rotary_tables"]  # fmt: skip


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
        self.norm: nn.Module | None = rms_norm(config.d_model, config)
        self.head: nn.Linear | None = nn.Linear(config.d_model, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        depths = config.num_nextn_predict_layers  # (after the head: a pipeline's last stage holds them)
        self.mtp: nn.ModuleDict | None = None
        if depths:
            self.mtp = nn.ModuleDict({str(k): MultiTokenPrediction(config, k + 1, lora) for k in range(depths)})
        name_dropouts(self)  # LoRA's dropout masks are keyed by their module's name, the same in every layout
        # Whole tensors by parameter name to start from instead of the seed (`GPT(pretrained=...)`); the next
        # `reset_parameters` copies each rank's shard of them and lets them go.
        self.init_source: dict[str, torch.Tensor] | None = None

    def forward(
        self, x: torch.Tensor, ahead: torch.Tensor | None = None, context: BatchContext = NO_CONTEXT
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``ahead``: the embeddings of multi-token prediction's tokens ahead ``[batch, seq, depth, d_model]``
        (`lit3d.models.mtp`), which the stage with the embedding makes from ``context`` and a pipeline's stages hand on
        with the hidden state, as a second output and input, to the stage with the depths."""
        if self.embed is not None:
            if self.config.num_nextn_predict_layers and context.ahead is not None:
                ahead = self._embed(context.ahead.tokens)
            x = self._embed(x)
        for block in self.blocks.values():
            x = block(x, context=context)
        if self.norm is not None:
            x = compute_dtype(self.norm(x))
        if self.head is None:
            return x if ahead is None else (x, ahead)
        logits = self._logits(x)
        if self.mtp is not None and ahead is not None and torch.is_grad_enabled():  # (training: evaluation skips it)
            logits = self._predict_ahead(x, ahead, logits, context)
        return logits

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings in the compute dtype (bf16-mixed: the residual stream in bf16 whatever holds the
        weights), times √d_model in that dtype where ``scale_embeddings`` (Gemma)."""
        x = compute_dtype(self.embed(tokens))
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.d_model**0.5, dtype=x.dtype)
        return x

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits, soft-capped where ``final_logit_softcapping`` is set (before the padding's -inf)."""
        logits, cap = self.head(hidden), self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return mask_vocab_padding(logits, self.config.vocab_size)

    def _predict_ahead(
        self, hidden: torch.Tensor, ahead: torch.Tensor, logits: torch.Tensor, context: BatchContext
    ) -> torch.Tensor:
        """Multi-token prediction (`lit3d.models.mtp`) from the decoder's final hidden state and the embeddings of the
        tokens ahead: each depth records its loss, which the caller adds to the objective, or (a pipeline's last stage:
        the context's ``objective_weight``) which joins it through backward, by way of the returned logits."""
        tokens, losses = context.ahead, []
        for k, depth in enumerate(self.mtp.values()):
            hidden = depth(hidden, ahead[:, :, k], context)
            depth_logits = self._logits(hidden)  # (the decoder's head)
            losses.append(cross_entropy(depth_logits, tokens.targets[..., k], tokens.scales[0, k]))
            depth.record(losses[-1])
        if context.objective_weight is None:
            return logits
        weight = context.objective_weight * self.config.mtp_loss_weight / len(losses)  # (their mean's weight)
        return AddToObjective.apply(logits, torch.stack(losses).sum(), weight)

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
        """The Mixture-of-Experts feed-forwards of the blocks this network (or pipeline stage) holds, the
        multi-token-prediction depths' included."""
        blocks = [*self.blocks.values(), *(depth.block for depth in self.mtp_depths())]
        return [block.mlp for block in blocks if isinstance(block.mlp, MoE)]

    def mtp_depths(self) -> list[MultiTokenPrediction]:
        """The multi-token-prediction depths this network (or pipeline stage) holds."""
        return list(self.mtp.values()) if self.mtp is not None else []

    def _init_values(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if init_adapter(name, tensor, generator):
            return
        if name.endswith("norm.weight"):
            tensor.fill_(0.0 if self.config.norm_unit_offset else 1.0)  # (Gemma's norms scale by 1 + weight)
            return
        if name.endswith("bias"):  # a linear's, the router's, the experts' stacked ones
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
