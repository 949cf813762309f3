"""`GPTConfig`: the shape of a Llama-style decoder, with named presets."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any, Literal

from lit3d.models.config_checks import LAYER_TYPES, check_attention, check_experts, check_latent_attention  # noqa: F401
from lit3d.models.presets import PRESETS
from lit3d.models.rope_settings import check_rope_scaling
from lit3d.moved import REMOVED_IN_LATER

AttentionBackend = Literal["auto", "sdpa", "flash"]

# The HuggingFace model families lit3d imports and exports (``model_type``), with their architecture (lit3d.hf).
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
Activation = Literal["silu", "gelu_pytorch_tanh"]


@dataclass
class GPTConfig:
    """Shape of a Llama-style GPT (RMSNorm, rotary attention with grouped-query heads, SwiGLU MLP).

    Args:
        name: Preset name, for display only.
        n_layer: Number of decoder blocks.
        n_head: Number of query heads.
        n_kv_head: Number of key/value heads (grouped-query attention); must divide ``n_head``.
            ``None`` means ``n_head`` (plain multi-head attention).
        d_model: Width of the residual stream.
        d_ff: Hidden width of the SwiGLU MLP. ``None`` means the Llama rule: 8/3 of ``d_model``
            rounded up to a multiple of 256.
        vocab_size: Number of token ids the tokenizer produces.
        max_seq_len: Longest sequence the model is meant to see.
        rope_theta: Base of the rotary embedding frequencies.
        rope_scaling: HuggingFace's ``rope_scaling``: ``{"rope_type": "llama3", "factor", "low_freq_factor",
            "high_freq_factor", "original_max_position_embeddings"}`` (Llama 3.1-3.3), ``{"rope_type": "yarn",
            "factor", "original_max_position_embeddings"}`` with optional ``beta_fast``, ``beta_slow``, ``mscale``,
            ``mscale_all_dim``, ``attention_factor``, ``truncate`` (DeepSeek-V3, Kimi K2) or ``{"rope_type": "linear",
            "factor"}``; ``None``: plain rotary embeddings (`lit3d.models.rotary`).
        norm_eps: Epsilon of the RMSNorms.
        tie_embeddings: Share the token embedding with the LM head.
        pad_vocab_multiple: Embedding and head rows are padded up to a multiple of this (padded logits are
            masked, so losses are unchanged). Keeps every tensor-parallel size up to this value possible
            with the same checkpoint shapes.
        init_std: Standard deviation of the normal initialisation of matrices.
        attention: ``"sdpa"`` (PyTorch), ``"flash"`` (the flash-attn package) or ``"auto"`` (flash-attn on
            CUDA in bf16/fp16 when installed, else SDPA).
        head_dim: Width of each attention head; ``None`` means ``d_model / n_head`` (Qwen3 sets it apart).
        qk_norm: An RMSNorm over each head of q and of k before rotary (Qwen3).
        qkv_bias: A bias on the q, k and v projections (Qwen2, Qwen2.5).
        family: The HuggingFace ``model_type`` an export writes (`FAMILIES`: ``llama``, ``mistral``, ``qwen2``,
            ``qwen3``; ``mixtral`` or ``qwen3_moe`` for an MoE model; ``deepseek_v3`` for latent attention).
        n_expert: Routed experts per Mixture-of-Experts layer; 0 means a dense model (`lit3d.models.moe`).
        n_expert_per_token: Experts each token is routed to (top-k).
        n_shared_experts: Experts every token also goes through (DeepSeek, Qwen2-MoE), as one wider SwiGLU.
        d_ff_expert: Hidden width of each expert; ``None`` means ``d_ff``.
        first_dense_layers: The first this many blocks keep a dense MLP (DeepSeek-V3: 3); the rest are MoE.
        router: ``"softmax"`` top-k (Mixtral, Qwen3-MoE) or ``"sigmoid"`` with a balancing bias (DeepSeek-V3).
        norm_topk_prob: The chosen experts' weights are renormalised to sum to 1 (HuggingFace's name; Mixtral and
            Qwen3-30B-A3B: True); False keeps the softmax router's probabilities as they are.
        aux_loss_coef: Weight of the load-balancing loss added to the cross-entropy (0 turns it off).
        router_bias_rate: How far the sigmoid router's bias moves per step toward an even load.
        capacity_factor: ``None`` routes dropless (every token reaches its experts: the default, and what keeps
            results independent of the layout); a number caps each expert at that many times its even share of a
            micro-batch's (token, choice) pairs on a rank, dropping the rest (Switch Transformer, GShard).
        kv_lora_rank: Width of the latent that keys and values are compressed to: multi-head latent attention (MLA,
            DeepSeek-V2/V3: `lit3d.models.latent_attention`) instead of grouped-query attention; ``None``: no MLA.
        q_lora_rank: Width of the queries' low-rank down-projection under MLA; ``None``: one plain ``q_proj``.
        qk_rope_head_dim: Under MLA, the part of each query and key head that is rotated (the key's part is one
            head shared by all).
        qk_nope_head_dim: Under MLA, the part of each query and key head without rotary embeddings; a head of q and
            k is ``qk_nope_head_dim + qk_rope_head_dim`` wide (``head_dim``).
        v_head_dim: Under MLA, the width of each value head (and of each head of the attention's output).
        rope_interleave: Under MLA, the rotated dims are laid out in interleaved pairs ``(x0, x1), (x2, x3), ...``
            (DeepSeek's checkpoints) rather than in halves.
        n_group: The sigmoid router's experts in this many groups; a token chooses among the experts of its
            ``topk_group`` best groups only, each group scored by the sum of its two best biased scores
            (DeepSeek-V3's group-limited routing); 1: no groups.
        topk_group: How many groups a token's experts may come from.
        routed_scaling_factor: The routed experts' weights are multiplied by this (DeepSeek-V3: 2.5).
        num_nextn_predict_layers: Multi-token prediction's depths (DeepSeek-V3: 1; `lit3d.models.mtp`): depth k
            predicts the token k + 1 places ahead, sharing the embedding and the head; 0: none.
        mtp_loss_weight: What the mean of the depths' losses weighs in the training objective (DeepSeek-V3: 0.3).
        sliding_window: A windowed layer's query sees the last this many tokens, itself included (HuggingFace's
            meaning; gpt-oss: 128, Gemma 3: 512 or 1024); ``None``: every layer sees the whole context before it.
        layer_types: Per block, ``"sliding_attention"`` or ``"full_attention"`` (gpt-oss alternates them, Gemma 3 has
            five windowed blocks to one full); ``None`` with a ``sliding_window``: every block is windowed (Mistral).
        attention_sinks: A learnt logit per head that joins each softmax's denominator and takes no value (gpt-oss's
            ``sinks``): a query may give a share of its attention to nothing.
        attention_bias: Biases on q, k, v and the output projection (gpt-oss); Qwen2's q/k/v-only biases are
            ``qkv_bias``.
        mlp_bias: Biases on the feed-forward's projections, the experts' and the router's (gpt-oss's MoE).
        swiglu_limit: gpt-oss's clamped SwiGLU: ``(clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)``, with ``g`` the
            gate clamped to at most ``limit``; ``None``: the plain gated MLP of ``hidden_act``.
        swiglu_alpha: The sigmoid's slope of gpt-oss's clamped SwiGLU.
        hidden_act: The gated MLP's activation: ``"silu"`` (SwiGLU) or ``"gelu_pytorch_tanh"`` (Gemma's GeGLU).
        query_pre_attn_scalar: Attention scores are scaled by this to the -1/2 (Gemma 3) instead of the head width's.
        rope_local_base_freq: The rotary base of the windowed layers, unscaled (Gemma 3: 10,000 against the full
            layers' ``rope_theta`` and ``rope_scaling``); ``None``: every layer's rotary is the same.
        sandwich_norm: An RMSNorm after attention and after the MLP too, before each joins the residual stream
            (Gemma 2 and 3).
        norm_unit_offset: Every RMSNorm scales by ``1 + weight`` (computed in fp32), its weight starting at 0 (Gemma).
        scale_embeddings: The token embeddings are multiplied by ``√d_model`` (Gemma).
        final_logit_softcapping: The logits go through ``c · tanh(logits / c)`` (Gemma 2, and Gemma 3 configs that set
            it); ``None``: no capping.
    """

    name: str = "custom"
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None
    d_model: int = 128
    d_ff: int | None = None
    vocab_size: int = 256
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    pad_vocab_multiple: int = 64
    init_std: float = 0.02
    attention: AttentionBackend = "auto"
    head_dim: int | None = None
    qk_norm: bool = False
    qkv_bias: bool = False
    family: str = "llama"
    n_expert: int = 0
    n_expert_per_token: int = 2
    n_shared_experts: int = 0
    d_ff_expert: int | None = None
    first_dense_layers: int = 0
    router: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True
    aux_loss_coef: float = 0.01
    router_bias_rate: float = 1e-3
    capacity_factor: float | None = None
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    rope_interleave: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0
    mtp_loss_weight: float = 0.3
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    attention_sinks: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    hidden_act: Activation = "silu"
    query_pre_attn_scalar: float | None = None
    rope_local_base_freq: float | None = None
    sandwich_norm: bool = False
    norm_unit_offset: bool = False
    scale_embeddings: bool = False
    final_logit_softcapping: float | None = None
    # 0.4's name of ``n_shared_experts`` (a checkpoint's saved config), read with a DeprecationWarning
    n_shared_expert: InitVar[int | None] = None
    # Derived in __post_init__, never set by hand.
    padded_vocab_size: int = field(init=False)

    def __post_init__(self, n_shared_expert: int | None) -> None:
        if n_shared_expert is not None:
            warnings.warn(
                "GPTConfig(n_shared_expert=...) is deprecated: it is n_shared_experts, HuggingFace's name "
                f"(removed in version {REMOVED_IN_LATER})",
                DeprecationWarning,
                stacklevel=3,
            )
            self.n_shared_experts = n_shared_expert
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.d_ff is None:
            self.d_ff = _round_up(int(8 * self.d_model / 3), 256)
        for key in (
            "n_layer",
            "n_head",
            "n_kv_head",
            "d_model",
            "d_ff",
            "vocab_size",
            "max_seq_len",
            "pad_vocab_multiple",
        ):
            if getattr(self, key) <= 0:
                raise ValueError(f"GPTConfig.{key}={getattr(self, key)} must be positive")
        if self.head_dim is None and self.d_model % self.n_head and self.kv_lora_rank is None:
            raise ValueError(f"n_head={self.n_head} does not divide d_model={self.d_model}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head={self.n_kv_head} does not divide n_head={self.n_head}")
        check_rope_scaling(self.rope_scaling)
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} is not one of {', '.join(FAMILIES)}")
        if self.attention not in ("auto", "sdpa", "flash"):
            raise ValueError(f"attention={self.attention!r} is not one of 'auto', 'sdpa', 'flash'")
        self._explicit_head_dim = self.head_dim
        check_latent_attention(self)
        if self.head_dim is None:
            self.head_dim = self.d_model // self.n_head
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be positive and even for rotary embeddings")
        self.padded_vocab_size = _round_up(self.vocab_size, self.pad_vocab_multiple)
        check_experts(self)
        check_attention(self)

    def window(self, index: int) -> int | None:
        """How many tokens block ``index``'s queries see (`sliding_window`), or ``None``: the whole context."""
        kinds = self.layer_types
        if self.sliding_window is None or (kinds and (index >= len(kinds) or kinds[index] != "sliding_attention")):
            return None  # (a multi-token-prediction depth's block, after the decoder's: full attention)
        return self.sliding_window

    def is_moe_layer(self, index: int) -> bool:
        return self.n_expert > 0 and index >= self.first_dense_layers

    @property
    def moe_layers(self) -> int:
        """How many layers `is_moe_layer` (all from ``first_dense_layers`` on; the planner asks this very often)."""
        return max(0, self.n_layer - self.first_dense_layers) if self.n_expert > 0 else 0

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> GPTConfig:
        """A preset by name (see `PRESETS`), with optional field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], "name": name, **overrides})

    @classmethod
    def load(cls, spec: str | dict[str, Any] | GPTConfig) -> GPTConfig:
        """A preset name, a YAML file of fields (``base: <preset>`` starts from a preset), or a dict of fields."""
        if isinstance(spec, GPTConfig):
            return spec
        if isinstance(spec, dict):
            return cls(**spec)
        if spec.endswith((".yaml", ".yml")):
            import yaml

            path = Path(spec)
            if not path.is_file():
                raise FileNotFoundError(f"model config file {spec!r} does not exist")
            fields = yaml.safe_load(path.read_text()) or {}
            base = fields.pop("base", None)
            return cls.from_name(base, **fields) if base else cls(**fields)
        return cls.from_name(spec)

    def to_dict(self) -> dict[str, Any]:
        """The settable fields (derived ones are left out): ``GPTConfig(**config.to_dict()) == config``.
        ``head_dim`` is kept only when it was set apart from ``d_model / n_head``."""
        fields = {name: getattr(self, name) for name in _SETTABLE}  # (the planner's search calls this often)
        fields["head_dim"] = self._explicit_head_dim
        return fields

    def replace(self, **changes: Any) -> GPTConfig:
        """A copy with some fields changed (derived fields are recomputed)."""
        return GPTConfig(**{**self.to_dict(), **changes})

    @property
    def num_params(self) -> int:
        """Parameter count, embedding and head included (counted once when tied), without vocab padding."""
        return (
            self.block_params(active=False) + self.embedding_params * (1 if self.tie_embeddings else 2) + self.d_model
        )

    @property
    def active_params(self) -> int:
        """Parameters one token uses: all of a dense model; attention, shared and k routed experts of an MoE."""
        return self.num_params - self.block_params(active=False) + self.block_params(active=True)

    @property
    def params_per_block(self) -> int:
        """Parameters of a block, averaged over the blocks (MoE and dense ones differ)."""
        return self.block_params(active=False) // self.n_layer

    def block_params(self, active: bool) -> int:
        """Parameters of all blocks; ``active``: only those one token uses (k of the routed experts)."""
        attention = self.attention_params + (4 if self.sandwich_norm else 2) * self.d_model
        biased = self.mlp_bias
        dense = 3 * self.d_model * self.d_ff + (2 * self.d_ff + self.d_model if biased else 0)
        expert = 3 * self.d_model * self.d_ff_expert + (2 * self.d_ff_expert + self.d_model if biased else 0)
        routed = self.n_expert_per_token if active else self.n_expert
        moe = (self.d_model + biased) * self.n_expert + (routed + self.n_shared_experts) * expert
        return self.n_layer * attention + (self.n_layer - self.moe_layers) * dense + self.moe_layers * moe

    @property
    def attention_params(self) -> int:
        """Parameters of one block's attention (its norm left out)."""
        d, hd, heads = self.d_model, self.head_dim, self.n_head
        if self.kv_lora_rank is None:
            attention = d * hd * (2 * heads + 2 * self.n_kv_head) + (heads if self.attention_sinks else 0)
            attention += 2 * hd if self.qk_norm else 0  # Qwen3's and Gemma 3's per-head q and k norms
            biases = hd * (heads + 2 * self.n_kv_head) if self.qkv_bias or self.attention_bias else 0  # Qwen2's
            return attention + biases + (d if self.attention_bias else 0)  # gpt-oss's
        latent, q_rank = self.kv_lora_rank, self.q_lora_rank
        queries = d * heads * hd if q_rank is None else q_rank * (d + 1 + heads * hd)
        keys_values = d * (latent + self.qk_rope_head_dim) + latent * (
            1 + heads * (self.qk_nope_head_dim + self.v_head_dim)
        )
        return queries + keys_values + heads * self.value_head_dim * d

    @property
    def value_head_dim(self) -> int:
        """Width of a value head: ``v_head_dim`` under latent attention, else ``head_dim``."""
        return self.head_dim if self.kv_lora_rank is None else self.v_head_dim

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model

    def flops_per_token(self, seq_len: int, adapter_params: int | None = None) -> int:
        """Training FLOPs per token (forward + backward): 6 per weight of every matmul (the embedding lookup is
        not one) plus attention's 12 · n_layer · d_model · seq_len (Chinchilla / PaLM accounting, no recompute).
        With LoRA's ``adapter_params`` the weights are frozen: 4 per weight (no weight gradient), 6 per adapter's."""
        matmul_params = self.active_params - (0 if self.tie_embeddings else self.embedding_params)
        per_weight = 6 if adapter_params is None else 4
        return per_weight * matmul_params + 6 * (adapter_params or 0) + self.attention_flops_per_token(seq_len)

    def attention_flops_per_token(self, seq_len: int) -> int:
        """The attention scores and their weighted sum, forward and backward: 6 · n_layer · heads · (q/k head + value
        head) · seq_len (12 · n_layer · heads · head_dim · seq_len where the heads are one width); a windowed block
        counts its window instead of the sequence where the window is shorter."""
        attended = sum(min(seq_len, self.window(i) or seq_len) for i in range(self.n_layer))
        return 6 * self.n_head * (self.head_dim + self.value_head_dim) * attended


_SETTABLE = tuple(f.name for f in dataclasses.fields(GPTConfig) if f.init)  # `GPTConfig.to_dict`'s fields


def check_model_fits_data(config: GPTConfig, datamodule: Any, module: Any = None) -> None:
    """Refuse a tokenizer larger than the model's vocabulary, or sequences longer than the model's context. A lit3d
    data module first settles its tokenizer for ``module`` (``tokenizer="auto"``: `GlobalBatchData.resolve_tokenizer`).
    """
    resolve = getattr(datamodule, "resolve_tokenizer", None)
    name = resolve(module) if resolve is not None else None
    vocab, seq_len = getattr(datamodule, "vocab_size", None), getattr(datamodule, "seq_len", None)
    if vocab is not None and vocab > config.vocab_size:
        which = f" (tokenizer={name!r})" if name is not None else ""
        raise ValueError(
            f"the tokenizer has {vocab} ids but the model's vocab_size={config.vocab_size}{which}: give "
            "the data module the model's own tokenizer"
        )
    if seq_len is not None and seq_len > config.max_seq_len:
        raise ValueError(f"seq_len={seq_len} is above the model's max_seq_len={config.max_seq_len}")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
