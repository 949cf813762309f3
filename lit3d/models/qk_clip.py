"""QK-clip (Kimi K2's MuonClip): after each optimizer step, every attention head whose largest logit of that step
passed a threshold ``τ`` has its query and key weights scaled so that the logit would have been ``τ``.

Per head ``h`` the step's largest logit ``S_h = max q·k · scale`` (over the step's forwards, every replica's batch,
every query and the keys it sees) gives ``γ_h = min(1, τ / S_h)``; then, as Kimi K2 does:

- grouped-query attention with a key head per query head (multi-head): the head's query and key rows (weights and
  biases) times ``√γ_h`` each;
- grouped-query attention whose key heads serve several query heads: the query rows times ``γ_h`` (a key head's scale
  would reach its group's other heads);
- latent attention: each head's unrotated query and key parts (``q_proj``/``q_b_proj``'s, ``kv_b_proj``'s) times
  ``√γ_h``, its rotated query part times ``γ_h`` (the rotated key part is every head's).

A clipped head's logits of the same inputs are then exactly ``γ_h`` times what they were. The rescaling runs in the
optimizer's step on the tensors it steps (`lit3d.models.muon.Muon.rescale_after_step`): the shards, ZeRO-1's slices and
master weights, so no later gather brings the unclipped values back.

NOTE: the logits come from one more ``q kᵀ`` per training forward, without gradient and in the attention's dtype
(`HeadLogits`), since PyTorch's fused kernels return no logit: about the FLOPs of the causal attention's own forward,
``CHUNK_ELEMENTS`` scores at a time. Recorded per forward and taken at the step's end, as `lit3d.models.moe.MoE.history`
is.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lit3d.models.documents import Documents

CHUNK_ELEMENTS = 2**24  # scores held at once (64 MiB in fp32)


class HeadLogits:
    """The largest logit of each of an attention layer's heads (this rank's), one entry per training forward since the
    last step, recompute left out (as `lit3d.models.moe.MoE.history`)."""

    def __init__(self) -> None:
        self.history: list[torch.Tensor] = []

    def record(
        self, q: torch.Tensor, k: torch.Tensor, scale: float, documents: Documents | None, window: int | None
    ) -> None:
        """Note the largest logit of each head of ``q`` and ``k`` (``[batch, seq, heads, dim]``, as the attention
        kernels take them) where the mask lets a query see a key. Training forwards only: evaluation does not clip."""
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1 or q.device.type == "meta":
            return
        with torch.no_grad():
            self.history.append(largest_logits(q, k, scale, documents, window))

    def take(self, forwards: int) -> torch.Tensor | None:
        """The largest of the last ``forwards`` entries (the step's: a pipeline's first step also runs each stage
        on placeholders to learn shapes, which the entries before them hold), the history cleared."""
        history, self.history = self.history[-forwards:], []
        return torch.stack(history).amax(dim=0) if history else None


def largest_logits(
    q: torch.Tensor, k: torch.Tensor, scale: float, documents: Documents | None, window: int | None
) -> torch.Tensor:
    """``[heads]``: each head's largest ``q·k · scale`` over the keys each query sees (causally, within ``window``, in
    its own document), a few rows of queries at a time, their mask made from the rows' and keys' indices (no
    ``seq x seq`` mask kept). In the attention's dtype (bf16 on a GPU's tensor cores under bf16-mixed: a clip's
    threshold does not need more; fp16's range is too short: fp32 there), returned in fp32; the scale after the max (a
    positive factor keeps the order)."""
    q, k = (t.to_local() if hasattr(t, "to_local") else t for t in (q, k))
    if q.dtype == torch.float16:
        q, k = q.float(), k.float()
    batch, seq, heads, _ = q.shape
    keys = k.repeat_interleave(heads // k.shape[2], dim=2).transpose(1, 2)
    queries, key_index = q.transpose(1, 2), torch.arange(seq, device=q.device)
    segments = documents.segments if documents is not None else None
    rows = max(1, CHUNK_ELEMENTS // (batch * heads * seq))
    largest = torch.full((heads,), -math.inf, device=q.device)
    for start in range(0, seq, rows):
        query_index = key_index[start : start + rows, None]
        seen = (key_index <= query_index) & ((query_index - key_index < window) if window else True)
        seen = seen[None, None]  # [1, 1, rows, seq]
        if segments is not None:  # (each row of the batch its own documents)
            seen = seen & (segments[:, None, start : start + rows, None] == segments[:, None, None, :])
        scores = (queries[:, :, start : start + rows] @ keys.transpose(-1, -2)).masked_fill(~seen, -math.inf)
        largest = torch.maximum(largest, scores.amax(dim=(0, 2, 3)).float() * scale)
    return largest


def record_logits(model: torch.nn.Module) -> None:
    """Have every attention layer of ``model`` record its heads' largest logits (QK-clip is on)."""
    for module in model.modules():
        if "logits" in vars(module):  # (`Attention`'s and `LatentAttention`'s attribute)
            module.logits = HeadLogits()


def attention_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The attention layers of ``model`` that record their logits, with their names (``blocks.3.attn``)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(vars(m).get("logits"), HeadLogits)]


def layer_row(name: str, n_layer: int) -> int:
    """An attention layer's row in the step's table: its block's index, or after the blocks a multi-token-prediction
    depth's."""
    parts = name.split(".")
    if "mtp" in parts:
        return n_layer + int(parts[parts.index("mtp") + 1])
    return int(parts[parts.index("blocks") + 1])


def head_offset(attention: torch.nn.Module) -> int:
    """The index of this rank's first head (tensor parallelism splits the heads)."""
    weight = query_projection(attention).weight
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return 0
    return mesh["tp"].get_local_rank() * (attention.config.n_head // mesh["tp"].size())


def query_projection(attention: torch.nn.Module) -> torch.nn.Module:
    """The projection whose rows are the queries' heads (latent attention's ``q_b_proj`` where it has one)."""
    latent_queries = getattr(attention, "q_b_proj", None)
    return latent_queries if latent_queries is not None else attention.q_proj


def step_maxima(model: torch.nn.Module, config: Any, forwards: int, device: torch.device) -> torch.Tensor:
    """``[blocks + depths, heads]``: the largest logit of each head of each layer this rank holds in the step's
    ``forwards`` (-inf elsewhere), taken from the layers' records; to be reduced with ``max`` over the ranks."""
    rows = config.n_layer + config.num_nextn_predict_layers
    table = torch.full((rows, config.n_head), -math.inf, device=device)
    for name, attention in attention_layers(model):
        largest = attention.logits.take(forwards)
        if largest is not None:
            offset = head_offset(attention)
            table[layer_row(name, config.n_layer), offset : offset + len(largest)] = largest
    return table


def row_factors(attention: torch.nn.Module, gamma: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each rescaled parameter's factor per row (of its whole tensor), by its name in ``attention``, for the heads'
    ``gamma`` (1 where a head is not clipped)."""
    config = attention.config
    root = gamma.sqrt()
    if hasattr(attention, "kv_b_proj"):  # latent attention
        nope, rope, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        query = torch.cat((root[:, None].expand(-1, nope), gamma[:, None].expand(-1, rope)), dim=1).flatten()
        key = torch.cat((root[:, None].expand(-1, nope), torch.ones_like(gamma)[:, None].expand(-1, v)), 1).flatten()
        prefix = "q_b_proj" if hasattr(attention, "q_b_proj") else "q_proj"
        return {f"{prefix}.weight": query, "kv_b_proj.weight": key}
    hd, groups = config.head_dim, config.n_head // config.n_kv_head
    factors = {}
    query = (gamma if groups > 1 else root).repeat_interleave(hd)
    key = root.repeat_interleave(hd) if groups == 1 else None
    for name, rows in (("q_proj", query), ("k_proj", key)):
        if rows is None:
            continue
        projection = getattr(attention, name)
        factors[f"{name}.weight"] = rows
        if getattr(projection, "bias", None) is not None:
            factors[f"{name}.bias"] = rows
    return factors


def clip_factors(
    model: torch.nn.Module, maxima: torch.Tensor, threshold: float, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """The factor of each row of every query and key tensor this rank holds whose heads ``maxima`` (the reduced
    `step_maxima`) clips, by parameter name (``prefix`` before ``model``'s names). A head whose largest logit is not
    finite is left alone (the loss is not either: the run stops on it)."""
    clipped = torch.isfinite(maxima) & (maxima > threshold)
    gamma_table = torch.where(clipped, threshold / maxima.clamp(min=threshold), 1.0).to(torch.float32)
    factors: dict[str, torch.Tensor] = {}
    for name, attention in attention_layers(model):
        gamma = gamma_table[layer_row(name, attention.config.n_layer)]
        if bool((gamma == 1).all()):
            continue
        for tensor_name, rows in row_factors(attention, gamma).items():
            factors[f"{prefix}{name}.{tensor_name}"] = rows
    return factors


def clip_after_step(module: Any, forwards: int, threshold: float) -> None:
    """QK-clip for the coming step of ``module`` (a `lit3d.GPT`, its ``forwards`` done): the step's largest logits (one
    ``max`` over every rank), logged as ``qk_clip/max_logit`` and ``qk_clip/clipped_heads``, and the clipped heads'
    factors handed to its Muon optimizer, which applies them after its updates (`Muon.rescale_after_step`)."""
    maxima = step_maxima(module.model, module.config, forwards, module.device)
    maxima = module.trainer.strategy.reduce(maxima, reduce_op="max")
    module.log("qk_clip/max_logit", maxima.max(), on_step=True, on_epoch=False, batch_size=1)
    clipped = (torch.isfinite(maxima) & (maxima > threshold)).sum().float()
    module.log("qk_clip/clipped_heads", clipped, on_step=True, on_epoch=False, batch_size=1)
    optimizer = module.optimizers(use_pl_optimizer=False)
    optimizer.rescale_after_step(clip_factors(module.model, maxima, threshold, prefix="model."))


def clip_refusal(config: Any, threshold: float | None) -> str | None:
    """Why a model cannot be QK-clipped, in one line (None when it can, or QK-clip is off)."""
    if threshold is None or not config.qk_norm:
        return None
    return (
        f"muon_qk_clip={threshold} with qk_norm=True: each query and key head is normalised after its projection, "
        "so scaling the projections changes no logit (the norms bound the logits already); leave muon_qk_clip unset"
    )
