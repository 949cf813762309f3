"""Mixture-of-Experts feed-forward layers: a router sends each token to ``n_expert_per_token`` of ``n_expert`` SwiGLU
experts and sums their outputs, weighted.

Routing is dropless by default: every token reaches its experts whatever the load, so results do not depend on the
layout (``capacity_factor`` caps each expert instead, dropping what exceeds it, as Switch and GShard do).
Expert parallelism (``ep_group``, set by the strategy) spreads the experts over ranks; each layer then sends the
tokens to the ranks of their experts and back with two all-to-alls (`dispatch`).

The load-balancing loss is computed per sequence and averaged over sequences (DeepSeek-V3's sequence-wise form of
the Switch loss): unlike a per-batch loss it is linear in the batch, so every data-parallel split of the batch
trains the same model. Where the loss is computed on another rank (a pipeline's last stage), the layer hands its
balance loss's gradient to backward itself (the batch context's ``objective_weight``), as Megatron-Core's MoE layers do.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit3d.models import lora_dropout
from lit3d.models.batch_context import NO_CONTEXT, BatchContext
from lit3d.models.config import GPTConfig
from lit3d.models.lora_dropout import LayoutFreeDropout, Samples
from lit3d.models.lora_settings import LoRA
from lit3d.models.loss import AddToObjective
from lit3d.models.mlp import MLP, gated


class Router(nn.Module):
    """Scores every expert for each token and picks ``k``; returns (chosen ``[n, k]``, weights ``[n, k]``,
    normalised scores ``[n, n_expert]``), in fp32.

    ``softmax`` (Mixtral, Qwen3-MoE): the top-k of the softmax, weights renormalised over the chosen. ``sigmoid``
    (DeepSeek-V3): the top-k of sigmoid scores plus ``expert_bias``, weights the chosen scores renormalised; the bias
    is not learnt but nudged after each step toward the under-loaded experts (`update_bias`), balancing the load
    without an auxiliary loss. It is a buffer: saved with the weights, never seen by the optimizer. With ``n_group``
    groups the top-k is taken in the best ``topk_group`` groups only (`eligible`). With ``norm_topk_prob`` False
    (some Qwen3-MoE configs) the weights are the chosen scores as they are; they are then multiplied by
    ``routed_scaling_factor`` (DeepSeek-V3).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.kind, self.k, self.renormalise = config.router, config.n_expert_per_token, config.norm_topk_prob
        self.groups, self.group_k, self.scale = config.n_group, config.topk_group, config.routed_scaling_factor
        self.gate = nn.Linear(config.d_model, config.n_expert, bias=config.mlp_bias)  # gpt-oss's is biased
        if self.kind == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(config.n_expert))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bias = self.gate.bias.to(x.dtype) if self.gate.bias is not None else None
        logits = F.linear(x, self.gate.weight.to(x.dtype), bias).float()
        if self.kind == "softmax":
            scores = logits.softmax(dim=-1)
            weights, chosen = scores.topk(self.k, dim=-1)
        else:
            scores = logits.sigmoid()
            chosen = self.eligible(scores + self.expert_bias).topk(self.k, dim=-1).indices
            weights = scores.gather(-1, chosen)
            scores = scores / scores.sum(dim=-1, keepdim=True)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights if self.scale == 1.0 else weights * self.scale, scores

    def eligible(self, biased: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's group-limited routing: ``biased`` ``[n, n_expert]`` with -inf but in each token's
        ``topk_group`` best of ``n_group`` groups of experts, a group scored by the sum of its two best."""
        if self.groups == 1:
            return biased
        grouped = biased.view(biased.shape[0], self.groups, -1)
        best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(self.group_k, dim=-1).indices
        kept = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=biased.device).scatter_(1, best, True)
        return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view_as(biased)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's balancing: raise the bias of experts below the mean load, lower it above."""
        if self.kind == "sigmoid":
            load = tokens_per_expert.float()
            self.expert_bias.add_(rate * torch.sign(load.mean() - load))


def balance_loss(
    scores: torch.Tensor, chosen: torch.Tensor, n_expert: int, seq_len: int, context_parallel: Any = None
) -> torch.Tensor:
    """Switch Transformer's load-balancing loss, per sequence, averaged over sequences: ``n_expert · Σ_e f_e P_e``
    with ``f_e`` the share of the sequence's routed slots that go to expert e and ``P_e`` its mean score there.
    1 when the load is even, up to ``n_expert`` when one expert takes everything.

    ``context_parallel`` (`lit3d.models.ring_attention.ContextParallel`): each rank holds ``seq_len`` tokens of every
    sequence; the slots and scores are summed over the CP ranks first (one all-reduce), so every rank gets the
    whole sequences' loss, and its gradient through this rank's scores comes scaled by the CP size: averaged over
    the ranks as gradients are, the parts add up to the whole sequences' gradient."""
    k = chosen.shape[-1]
    per_sequence = chosen.view(-1, seq_len * k)
    counts = torch.zeros(per_sequence.shape[0], n_expert, device=chosen.device)
    counts.scatter_add_(1, per_sequence, torch.ones_like(per_sequence, dtype=counts.dtype))
    score_sums = scores.view(-1, seq_len, n_expert).float().sum(dim=1)
    if context_parallel is not None and context_parallel.size > 1:
        cp = context_parallel
        whole = torch.cat((counts, score_sums.detach()))
        torch.distributed.all_reduce(whole, group=cp.group)
        counts, whole_scores = whole.chunk(2)
        score_sums = whole_scores + cp.size * (score_sums - score_sums.detach())
        seq_len = seq_len * cp.size
    share, mean_score = counts / (seq_len * k), score_sums / seq_len
    return n_expert * (share * mean_score).sum(dim=-1).mean()


def balance_objective(layers: list[MoE], coef: float) -> torch.Tensor:
    """The MoE layers' load-balancing term of their last forward's objective, ``coef`` times their losses' sum."""
    return coef * torch.stack([layer.stats[0] for layer in layers]).sum()


def step_balance(layers: list[MoE], rows: int, n_expert: int, forwards: int, device: torch.device) -> torch.Tensor:
    """This rank's part of a step's balance, ``[rows, 2 + n_expert]`` by block index: each layer's balance loss (the
    mean of its last ``forwards`` forwards), 1 (it is held here) and its tokens per expert (their sum); their
    histories emptied. Summed over the ranks, a block's tokens per expert are a multiple of the step's: every rank
    routes its own tokens (data, context and expert parallel ranks), or its tensor-parallel peers' again."""
    stats = torch.zeros(rows, 2 + n_expert, device=device)  # (the same on every rank, whichever layers it holds)
    for layer in layers:
        history, layer.history = layer.history[-forwards:], []
        stats[layer.index, 0] = torch.stack([aux for aux, _ in history]).mean()
        stats[layer.index, 1] = 1.0
        stats[layer.index, 2:] = torch.stack([tokens for _, tokens in history]).sum(dim=0)
    return stats


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``x`` ``[n, a]`` in groups of ``counts`` rows, group g times ``weight[g]`` ``[a, b]``: ``[n, b]``.

    PyTorch's grouped GEMM on GPUs that have it (bf16, Hopper and later); one matmul per group elsewhere.
    """
    if _has_grouped_gemm(x, weight):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, weight, offs=offsets)
    parts = x.split(counts)
    return torch.cat([part @ weight[g] for g, part in enumerate(parts)]) if parts else x.new_empty(0, weight.shape[2])


def _has_grouped_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not (x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == weight.dtype == torch.bfloat16):
        return False
    aligned = x.shape[-1] % 8 == 0 and weight.shape[-1] % 8 == 0  # 16-byte rows (a LoRA rank of 4 is not)
    return aligned and torch.cuda.get_device_capability(x.device) >= (9, 0)


class Experts(nn.Module):
    """``n_expert`` gated MLPs (`lit3d.models.mlp.gated`) as three stacked weights (``[expert, in, out]``), with stacked
    biases (``[expert, out]``) where ``mlp_bias`` is set; under expert parallelism a rank holds a contiguous run of
    them.

    With ``lora`` targeting ``gate``, ``up`` or ``down``, each expert's projection gets its own adapter, stacked the
    same way: ``{role}_proj_lora_a`` ``[expert, in, rank]`` and ``{role}_proj_lora_b`` ``[expert, rank, out]``
    (`lit3d.models.lora`), split over expert parallelism with the experts. (A shared expert, `MoE.shared`, stays
    frozen.) Their dropout keys each row by its token and expert (``row_keys``: `lit3d.models.lora_dropout`), wherever
    it runs."""

    def __init__(self, config: GPTConfig, lora: LoRA | None = None) -> None:
        super().__init__()
        n_expert, d_model, d_ff = config.n_expert, config.d_model, config.d_ff_expert
        self.gate_proj = nn.Parameter(torch.empty(n_expert, d_model, d_ff))
        self.up_proj = nn.Parameter(torch.empty(n_expert, d_model, d_ff))
        self.down_proj = nn.Parameter(torch.empty(n_expert, d_ff, d_model))
        if config.mlp_bias:  # gpt-oss: each expert's projections biased, ``[expert, out]``
            self.gate_proj_bias = nn.Parameter(torch.empty(n_expert, d_ff))
            self.up_proj_bias = nn.Parameter(torch.empty(n_expert, d_ff))
            self.down_proj_bias = nn.Parameter(torch.empty(n_expert, d_model))
        self.biased = config.mlp_bias
        self.act, self.limit, self.alpha = config.hidden_act, config.swiglu_limit, config.swiglu_alpha
        self.adapted = tuple(role for role in ("gate", "up", "down") if lora is not None and role in lora.targets)
        for role in self.adapted:
            inner, outer = (d_ff, d_model) if role == "down" else (d_model, d_ff)
            self.register_parameter(f"{role}_proj_lora_a", nn.Parameter(torch.empty(n_expert, inner, lora.rank)))
            self.register_parameter(f"{role}_proj_lora_b", nn.Parameter(torch.empty(n_expert, lora.rank, outer)))
        self.scaling = lora.scaling if lora is not None else 0.0
        self.dropout = LayoutFreeDropout(lora.dropout if lora is not None else 0.0)
        # Under expert parallelism 1 / ep: each rank's expert gradients sum the tokens of its whole EP group (the
        # all-to-all's backward), so any data-parallel average over the ranks that hold the same experts then
        # yields the average over all data-parallel ranks, as for every other parameter.
        self.grad_scale = 1.0

    def forward(self, x: torch.Tensor, counts: list[int], row_keys: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: tokens sorted by expert, ``counts[e]`` of them for local expert e; ``row_keys``: their dropout's."""
        rows = torch.tensor(counts, device=x.device) if self.biased else None  # (each expert's bias, on its rows)
        gate, up = (self._project(role, x, counts, row_keys, rows) for role in ("gate", "up"))
        return self._project("down", gated(gate, up, self.act, self.limit, self.alpha), counts, row_keys, rows)

    def _project(
        self, role: str, x: torch.Tensor, counts: list[int], row_keys: torch.Tensor | None, rows: torch.Tensor | None
    ) -> torch.Tensor:
        """Each expert's ``role`` projection of its tokens (plus its bias on each of its ``rows``), with its adapter if
        it has one."""
        out = grouped_mm(x, self._weight(f"{role}_proj", x.dtype), counts)
        if rows is not None:
            bias = self._weight(f"{role}_proj_bias", x.dtype)
            out = out + bias.repeat_interleave(rows, dim=0, output_size=x.shape[0])
        if role not in self.adapted:
            return out
        dropped = self.dropout.on_rows(x, row_keys, role)
        a, b = (self._weight(f"{role}_proj_lora_{which}", x.dtype) for which in "ab")
        return out + self.scaling * grouped_mm(grouped_mm(dropped, a, counts), b, counts)

    def _weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        weight = _local(getattr(self, name)).to(dtype)
        return _ScaleGrad.apply(weight, self.grad_scale) if self.grad_scale != 1.0 else weight


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class MoE(nn.Module):
    """The feed-forward of an MoE block: routed experts (plus ``n_shared_experts`` always-on ones, one SwiGLU of
    that many times the expert width). After a forward, ``stats`` holds the balance loss and the tokens per
    expert of that forward (the balance loss's term of the objective); ``history`` keeps them for each training
    forward since it was last cleared, recompute left out (the logged balance)."""

    def __init__(self, config: GPTConfig, index: int = 0, lora: LoRA | None = None) -> None:
        super().__init__()

        self.index = index  # the block's
        self.n_expert, self.k = config.n_expert, config.n_expert_per_token
        self.router = Router(config)
        self.experts = Experts(config, lora)
        shared = config.n_shared_experts * config.d_ff_expert
        self.shared = MLP(config.replace(d_ff=shared)) if shared else None  # (frozen under LoRA)
        self.ep_group = None  # expert parallelism: the process group the experts are split over
        self.context_parallel = None  # context parallelism: the balance loss sums its sequences over the CP ranks
        self.coef, self.capacity_factor = config.aux_loss_coef, config.capacity_factor
        self.stats: tuple[torch.Tensor, torch.Tensor] | None = None
        self.history: list[tuple[torch.Tensor, torch.Tensor]] = []  # stats of the training forwards, until cleared

    # NOTE: left to eager under `compile`: dropless routing reads its split sizes on the host (data-dependent
    # shapes), and the rest of the block (attention, norms) is where compiling pays.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor, context: BatchContext = NO_CONTEXT) -> torch.Tensor:
        batch, seq, width = x.shape
        flat = x.reshape(-1, width)
        chosen, weights, scores = self.router(flat)
        tokens_per_expert = torch.bincount(chosen.flatten(), minlength=self.n_expert)
        aux = balance_loss(scores, chosen, self.n_expert, seq, self.context_parallel)
        self.stats = (aux, tokens_per_expert.detach())
        record = (aux.detach(), self.stats[1])
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:  # training, not a recompute
            self.history.append(record)
        # Every (token, choice) pair, sorted by expert: the rows each expert computes are contiguous.
        order = chosen.flatten().argsort(stable=True)
        computed = tokens_per_expert
        if self.capacity_factor is not None:  # each expert keeps its first `capacity` pairs, in token order
            order, computed = _within_capacity(order, tokens_per_expert, self.capacity_factor)
        routed = flat[order // self.k]
        keys = self._dropout_keys(context.samples, batch, seq, order, chosen, x.device)
        if self.ep_group is None:
            out = self.experts(routed, computed.tolist(), keys)
        else:
            out = dispatch(routed, computed, self.experts, self.ep_group, keys)
        combined = _in_token_order(out, order, flat.shape[0] * self.k).view(-1, self.k, width)
        y = (combined * weights.unsqueeze(-1).to(combined.dtype)).sum(dim=1).view(batch, seq, width)
        if context.objective_weight is not None and torch.is_grad_enabled():  # a pipeline stage: through backward
            y = AddToObjective.apply(y, aux, context.objective_weight * self.coef)
        return y if self.shared is None else y + self.shared(x)

    def _dropout_keys(
        self,
        samples: Samples | None,
        batch: int,
        seq: int,
        order: torch.Tensor,
        chosen: torch.Tensor,
        device: torch.device,
    ) -> torch.Tensor | None:
        """The dropout keys of the routed rows (`lit3d.models.lora_dropout`) of the rows ``samples``: each row's
        token's, mixed with its expert's index; ``None`` without dropout or outside a training step."""
        dropout = self.experts.dropout
        if not (dropout.active() and self.experts.adapted and samples is not None):
            return None
        tokens = dropout.token_keys(samples, batch, seq, device).flatten()
        return lora_dropout.mix(tokens[order // self.k] ^ lora_dropout.mix(chosen.flatten()[order]))


def _in_token_order(out: torch.Tensor, order: torch.Tensor, pairs: int) -> torch.Tensor:
    """The rows of ``out`` (the pairs of ``order``, sorted by expert) back in (token, choice) order, ``pairs`` of
    them: a pair an expert dropped (capacity) reads a zero row. NOTE: a gather, which keeps only its indices for
    backward; ``index_copy`` into zeros kept its source too (every computed row, once more per MoE block)."""
    rows = torch.cat((out, out.new_zeros(1, out.shape[1])))
    where = torch.full((pairs,), out.shape[0], dtype=torch.long, device=out.device)
    where[order] = torch.arange(out.shape[0], device=out.device)
    return rows[where]


def _within_capacity(
    order: torch.Tensor, tokens_per_expert: torch.Tensor, capacity_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of ``order`` (sorted by expert) that fit each expert's capacity, and how many each expert keeps."""
    n_expert = tokens_per_expert.numel()
    capacity = math.ceil(capacity_factor * order.numel() / n_expert)
    starts = torch.cumsum(tokens_per_expert, 0) - tokens_per_expert
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts.repeat_interleave(tokens_per_expert)
    return order[rank_in_expert < capacity], tokens_per_expert.clamp(max=capacity)


def dispatch(
    routed: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    experts: Experts,
    group,
    row_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expert parallelism: send each row of ``routed`` (sorted by expert) to the rank holding its expert, run the
    local experts on what arrives, and send the results back, in ``routed``'s order. ``row_keys`` (the rows' dropout
    keys) travel with their rows.

    NOTE: dropless routing makes the split sizes data-dependent, so they are exchanged first (a small all-to-all)
    and read on the host, as Megatron-Core and torchtitan do.
    """
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    ranks = torch.distributed.get_world_size(group)
    local = tokens_per_expert.numel() // ranks
    received_counts = torch.empty_like(tokens_per_expert)
    torch.distributed.all_to_all_single(received_counts, tokens_per_expert, group=group)
    send = tokens_per_expert.view(ranks, local).sum(dim=1).tolist()
    counts = received_counts.view(ranks, local)  # [source rank, local expert]
    receive = counts.sum(dim=1).tolist()
    arrived = all_to_all_single_autograd(routed, receive, send, group)
    # Arrivals are ordered by source rank, then expert; the experts want them by expert, then source rank.
    by_source = torch.arange(counts.numel(), device=counts.device).view(ranks, local)
    segment = torch.repeat_interleave(by_source.flatten(), counts.flatten())
    regroup = (segment % local * ranks + segment // local).argsort(stable=True)
    keys = None
    if row_keys is not None:
        keys = row_keys.new_empty(arrived.shape[0])
        torch.distributed.all_to_all_single(keys, row_keys, receive, send, group=group)
        keys = keys[regroup]
    out = experts(arrived[regroup], counts.sum(dim=0).tolist(), keys)
    back = torch.empty_like(out).index_copy(0, regroup, out)
    return all_to_all_single_autograd(back, send, receive, group)
