"""Multi-head latent attention (MLA: DeepSeek-V2, DeepSeek-V3, Kimi K2), as transformers' ``DeepseekV3Attention``
computes it.

Keys and values come from one small latent per token: ``kv_a_proj_with_mqa`` makes the latent (``kv_lora_rank``
wide) and a rotated key part (``qk_rope_head_dim``) that all heads share; the latent is normalised and
``kv_b_proj`` expands it into each head's unrotated key part (``qk_nope_head_dim``) and its value (``v_head_dim``).
Queries go through a low-rank pair too (``q_a_proj`` → RMSNorm → ``q_b_proj``), or one ``q_proj`` when
``q_lora_rank`` is None. Each query and key head is its unrotated part followed by its rotated part; values are
narrower, and ``o_proj`` reads ``n_head · v_head_dim``. Rotary embeddings reach only the rotated parts ("decoupled"),
laid out in interleaved pairs when ``rope_interleave`` (DeepSeek's checkpoints). Under YaRN the softmax scale
``1/√(qk head)`` is multiplied by `Rope.softmax_correction`.

Under tensor parallelism (`lit3d.models.tp_plan`) ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` split by heads
and ``o_proj`` by its input; the down-projections and their norms are small and every rank computes them whole. Under
context parallelism the queries and keys are rotated at their tokens' true positions and the ring attention
(`lit3d.models.ring_attention`) passes each head's key and its narrower value around the ranks.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lit3d.models.attention import causal_attention
from lit3d.models.batch_context import NO_CONTEXT, BatchContext
from lit3d.models.config import GPTConfig
from lit3d.models.lora import LoRA, linear, project
from lit3d.models.qk_clip import HeadLogits
from lit3d.models.ring_attention import ContextParallel, ring_attention
from lit3d.models.rotary import Rope, apply_rotary, position_tables

# NOTE: transformers' DeepSeek-V3 normalises the two latents with its RMSNorm's default epsilon, whatever the
# config's ``rms_norm_eps`` (DeepSeek's own code does the same).
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """Multi-head latent attention (see the module's docstring); the same parameter names as transformers'."""

    def __init__(self, config: GPTConfig, lora: LoRA | None = None) -> None:
        super().__init__()
        self.config = config
        d, heads, latent, rope = config.d_model, config.n_head, config.kv_lora_rank, config.qk_rope_head_dim
        if config.q_lora_rank is None:
            self.q_proj = linear(d, heads * config.head_dim, lora, "attn.q_proj")
        else:
            self.q_a_proj = linear(d, config.q_lora_rank, lora, "attn.q_a_proj")
            self.q_a_layernorm = nn.RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = linear(config.q_lora_rank, heads * config.head_dim, lora, "attn.q_b_proj")
        self.kv_a_proj_with_mqa = linear(d, latent + rope, lora, "attn.kv_a_proj_with_mqa")
        self.kv_a_layernorm = nn.RMSNorm(latent, eps=LATENT_NORM_EPS)
        self.kv_b_proj = linear(latent, heads * (config.qk_nope_head_dim + config.v_head_dim), lora, "attn.kv_b_proj")
        self.o_proj = linear(heads * config.v_head_dim, d, lora, "attn.o_proj")
        self.rope = Rope.of(config.rope_theta, config.rope_scaling)
        # NOTE: the YaRN correction of the softmax scale, folded into the queries: every kernel keeps its 1/√(qk head).
        self.query_scale = self.rope.softmax_correction()
        # Under context parallelism, x holds this rank's share of each sequence (`lit3d.models.ring_attention`).
        self.context_parallel: ContextParallel | None = None
        self.logits: HeadLogits | None = None  # QK-clip's record of the largest logits (`lit3d.models.qk_clip`)

    def forward(self, x: torch.Tensor, context: BatchContext = NO_CONTEXT) -> torch.Tensor:
        config, (batch, seq, _), cp = self.config, x.shape, self.context_parallel
        nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        # NOTE: -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q_nope, q_rope = self._queries(x, context).view(batch, seq, -1, nope + rope).split([nope, rope], dim=-1)
        k_nope, k_rope, v = self._keys_values(x, context)
        docs = context.documents_for(batch, seq)
        cos, sin = position_tables(self.rope, rope, q_rope, docs, cp, config.max_seq_len)  # (CP: true positions)
        q_rope, k_rope = (apply_rotary(self._halves(t), cos, sin) for t in (q_rope, k_rope))
        q = torch.cat((q_nope, q_rope), dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        k = torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        if self.logits is not None:
            self.logits.record(q, k, q.shape[-1] ** -0.5, docs, None)
        y = causal_attention(q, k, v, config.attention, docs) if cp is None else ring_attention(q, k, v, cp, docs)
        return project(self.o_proj, y.reshape(batch, seq, -1), context)

    def _keys_values(self, x: torch.Tensor, context: BatchContext) -> tuple[torch.Tensor, ...]:
        """Each head's unrotated key part and value ``[batch, seq, heads, ...]``, expanded from the normalised latent,
        and the key part all heads share ``[batch, seq, 1, qk_rope_head_dim]`` (not rotated yet)."""
        config, (batch, seq, _) = self.config, x.shape
        widths = [config.kv_lora_rank, config.qk_rope_head_dim]
        latent, shared = project(self.kv_a_proj_with_mqa, x, context).split(widths, dim=-1)
        kv = project(self.kv_b_proj, self.kv_a_layernorm(latent), context)
        k_nope, v = kv.view(batch, seq, -1, config.qk_nope_head_dim + config.v_head_dim).split(
            [config.qk_nope_head_dim, config.v_head_dim], dim=-1
        )
        return k_nope, heads_share(shared).unsqueeze(2), v

    def _queries(self, x: torch.Tensor, context: BatchContext) -> torch.Tensor:
        if self.config.q_lora_rank is None:
            return project(self.q_proj, x, context)
        return project(self.q_b_proj, self.q_a_layernorm(project(self.q_a_proj, x, context)), context)

    def _halves(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s rotated dims in rotate-half order: DeepSeek's interleaved pairs ``(x0, x1), (x2, x3), ...`` become
        ``(x0, x2, ..., x1, x3, ...)``, which the same rotation turns as transformers' interleaved one does (q and k
        alike, so their products are unchanged)."""
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if self.config.rope_interleave else x


def heads_share(shared: torch.Tensor) -> torch.Tensor:
    """The rotated key part all heads share, as a plain tensor.

    NOTE: under tensor parallelism it comes from a replicated projection as a replicated DTensor, and each rank uses it
    for its own heads only: its gradient on a rank is that rank's heads' share of the whole, a partial sum that DTensor
    adds up over the TP ranks in backward."""
    from torch.distributed.tensor import DTensor, Partial

    if isinstance(shared, DTensor):
        return shared.to_local(grad_placements=[Partial()] * shared.device_mesh.ndim)
    return shared
