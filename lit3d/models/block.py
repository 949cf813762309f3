"""A decoder block (`Block`): attention, grouped-query (`Attention`) or latent (`lit3d.models.latent_attention`), and a
SwiGLU MLP or a Mixture of Experts, each after its RMSNorm, each added to the residual stream.
`lit3d.models.transformer` stacks them; a multi-token-prediction depth (`lit3d.models.mtp`) holds one more."""

from __future__ import annotations

import torch
import torch.nn as nn

from lit3d.models.attention import causal_attention
from lit3d.models.batch_context import NO_CONTEXT, BatchContext
from lit3d.models.config import GPTConfig
from lit3d.models.latent_attention import LatentAttention
from lit3d.models.lora import LoRA, linear, project
from lit3d.models.mlp import MLP
from lit3d.models.moe import MoE
from lit3d.models.ring_attention import ContextParallel, ring_attention
from lit3d.models.rotary import Rope, apply_rotary, position_tables


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
