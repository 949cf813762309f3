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
from lit3d.models.norms import rms_norm
from lit3d.models.qk_clip import HeadLogits
from lit3d.models.ring_attention import ContextParallel, ring_attention
from lit3d.models.rotary import Rope, apply_rotary, position_tables


class Sinks(nn.Module):
    """gpt-oss's attention sinks: one learnt logit per query head (``weight``), split with the heads under TP."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads))

    def heads(self) -> torch.Tensor:
        """This rank's heads' sinks (all of them but under tensor parallelism)."""
        weight = self.weight
        return weight.to_local() if hasattr(weight, "to_local") else weight


class Attention(nn.Module):
    """Grouped-query attention over the whole context before each token, or over a window of it
    (`GPTConfig.window`), with gpt-oss's sinks and Gemma's scale and rotary base where the config has them."""

    def __init__(self, config: GPTConfig, lora: LoRA | None = None, index: int = 0) -> None:
        super().__init__()
        self.config = config
        hd, d = config.head_dim, config.d_model
        bias, out_bias = config.qkv_bias or config.attention_bias, config.attention_bias  # Qwen2: q, k, v; gpt-oss: all
        self.q_proj = linear(d, config.n_head * hd, lora, "attn.q_proj", bias)
        self.k_proj = linear(d, config.n_kv_head * hd, lora, "attn.k_proj", bias)
        self.v_proj = linear(d, config.n_kv_head * hd, lora, "attn.v_proj", bias)
        self.o_proj = linear(config.n_head * hd, d, lora, "attn.o_proj", out_bias)
        # Qwen3, Gemma 3: each head of q and of k normalised before rotary (under TP, a rank's heads: `tp_plan`).
        self.q_norm = rms_norm(hd, config) if config.qk_norm else None
        self.k_norm = rms_norm(hd, config) if config.qk_norm else None
        self.sinks = Sinks(config.n_head) if config.attention_sinks else None
        # Under context parallelism, x holds this rank's share of each sequence (`lit3d.models.ring_attention`).
        self.context_parallel: ContextParallel | None = None
        self.window = config.window(index)
        self.rope = Rope.of(config.rope_theta, config.rope_scaling)
        if self.window is not None and config.rope_local_base_freq is not None:  # Gemma 3's windowed layers
            self.rope = Rope.of(config.rope_local_base_freq, None)
        scalar = config.query_pre_attn_scalar
        self.scale = None if scalar is None else scalar**-0.5
        self.logits: HeadLogits | None = None  # QK-clip's record of the largest logits (`lit3d.models.qk_clip`)

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
        sinks = None if self.sinks is None else self.sinks.heads()
        if self.logits is not None:
            self.logits.record(q, k, self.scale or hd**-0.5, docs, self.window)
        if cp is None:
            y = causal_attention(q, k, v, self.config.attention, docs, self.window, sinks, self.scale)
        else:
            y = ring_attention(q, k, v, cp, docs, self.window, sinks, self.scale)
        return project(self.o_proj, y.reshape(batch, seq, -1), context)


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)); the attention is multi-head latent attention
    (`lit3d.models.latent_attention`) where ``config.kv_lora_rank`` is set, and the MLP a Mixture of Experts
    (`lit3d.models.moe.MoE`) in the blocks ``config.is_moe_layer`` names. With ``sandwich_norm`` (Gemma) each output is
    normalised again before it joins the residual stream (``post_attn_norm``, ``post_mlp_norm``)."""

    def __init__(self, config: GPTConfig, index: int = 0, lora: LoRA | None = None) -> None:
        super().__init__()
        self.attn_norm = rms_norm(config.d_model, config)
        self.attn = LatentAttention(config, lora) if config.kv_lora_rank else Attention(config, lora, index)
        self.mlp_norm = rms_norm(config.d_model, config)
        self.mlp = MoE(config, index, lora) if config.is_moe_layer(index) else MLP(config, lora)
        sandwich = config.sandwich_norm
        self.post_attn_norm = rms_norm(config.d_model, config) if sandwich else None
        self.post_mlp_norm = rms_norm(config.d_model, config) if sandwich else None

    def forward(self, x: torch.Tensor, context: BatchContext = NO_CONTEXT) -> torch.Tensor:
        # NOTE: the context by keyword: tensor parallelism's input hooks on attn and mlp take one positional argument.
        y = self.attn(compute_dtype(self.attn_norm(x)), context=context)
        x = x + (y if self.post_attn_norm is None else self.post_attn_norm(y))
        y = self.mlp(compute_dtype(self.mlp_norm(x)), context=context)
        return x + (y if self.post_mlp_norm is None else self.post_mlp_norm(y))


def compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in autocast's dtype where autocast is on (bf16-mixed): a norm's output, cast once before it enters the
    linears, instead of once by each of them (autocast casts every linear's input anew and keeps each copy for
    backward: three for q, k and v). Under sequence parallelism its gather then moves bf16 too."""
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x
