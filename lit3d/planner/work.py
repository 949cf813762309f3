"""What one rank computes for one micro-batch on its pipeline stage: the shapes of its GEMMs, attention's FLOPs,
and the bytes and kernels of its elementwise work, eager or fused, counted from the model's shapes and the layout's
splits. No time here: `lit3d.planner.clock` prices it on a device.

Elementwise work is counted per token and per element of the width it runs on, operator by operator, as PyTorch
runs a Llama block eagerly: an RMSNorm in fp32 (upcast, square, mean, scale, downcast, weight: 7 kernels, 36 bytes
per element), rotary embedding of q and k through fp32 (3 kernels each, 20 bytes), the attention output made
contiguous (4 bytes), each residual add (6 bytes), SwiGLU's SiLU and product (2 kernels, 10 bytes). Fused (one
kernel per region, as ``torch.compile`` or Transformer Engine runs it): norm and residual read and write once (8
bytes), rotary 4, SwiGLU 6. Backward moves `BACKWARD_ELEMENTWISE` times the forward's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from lit3d.models.config import GPTConfig
from lit3d.models.lora_settings import LoRA
from lit3d.parallel.layout import Layout
from lit3d.planner.shapes import TP_SPLITS_INPUTS, TP_WHOLE, linear_widths
from lit3d.planner.sums import StageSums

# Bytes per element and kernels of each elementwise operator of a block's forward, (eager, fused).
NORM = ((36, 7), (8, 1))  # fused: with the residual add before it
ROTARY = ((20, 3), (4, 0.5))  # of q, and of k (fused: q and k in one kernel)
CONTIGUOUS = ((4, 1), (4, 1))  # attention's output, heads back to the hidden width
RESIDUAL = ((6, 1), (0, 0))  # fused into the norm that follows
SWIGLU = ((10, 2), (6, 1))
ROUTING = ((12, 3), (12, 3))  # an MoE block's rows: gathered to the experts, scattered back, weighted and summed
# The loss over the vocabulary, forward and backward, per logit: the upcast to fp32 (6 bytes), log-softmax's max, sum
# and output passes (16), the loss's gradient written whole (4), log-softmax's backward (16), the downcast (6).
CROSS_ENTROPY = (48, 7)
# The embedding's lookup and its gradient's scatter-add (fp32).
EMBEDDING = (14, 3)


@dataclass(frozen=True)
class Gemm:
    """``count`` forward GEMMs of an (m x k) by (k x n) product; backward runs each again twice, for the input's
    gradient (m, k, n) and the weight's (k, n, m), or once for a ``frozen`` weight (LoRA's base: no gradient);
    ``fp8``: a block linear that FP8 training runs in FP8, forward and backward."""

    m: float
    n: float
    k: float
    count: float = 1.0
    frozen: bool = False
    fp8: bool = False

    @property
    def flops(self) -> float:
        return 2 * self.m * self.n * self.k * self.count

    def backward(self) -> tuple[Gemm, ...]:
        inputs = Gemm(self.m, self.k, self.n, self.count, fp8=self.fp8)
        return (inputs,) if self.frozen else (inputs, Gemm(self.k, self.n, self.m, self.count, fp8=self.fp8))


@dataclass(frozen=True)
class Work:
    """One micro-batch of one pipeline rank's layers, forward (backward follows from it)."""

    block_gemms: tuple[Gemm, ...]  # of all its blocks
    head_gemms: tuple[Gemm, ...]  # the output layer (last stage)
    attention_flops: float  # causal, forward, all its blocks
    block_bytes: float  # elementwise, forward, all its blocks
    block_kernels: float  # elementwise kernels of the forward
    other_bytes: float  # the embedding and the loss, forward and backward
    other_kernels: float
    blocks: int
    split: bool  # its linears are split over tensor parallelism


def stage_work(
    config: GPTConfig,
    layout: Layout,
    micro_batch_size: int,
    seq_len: int,
    lora: LoRA | None,
    sp: bool,
    fused: bool,
    stage: StageSums,
    fp8: bool = False,
) -> Work:
    """What one rank of ``layout`` computes per micro-batch of ``micro_batch_size`` sequences of ``seq_len`` tokens on
    ``stage`` (its blocks, MoE ones among them, the embedding on the first stage, the output layer and loss on the
    last), with ``lora``'s adapters if given; ``sp``: sequence parallelism is on; ``fp8``: the blocks' linears run in
    FP8 (not the router, the experts or the head: `lit3d.strategies.split.float8`)."""
    blocks, moe = stage.blocks, stage.moe
    tp, tokens = layout.tp, micro_batch_size * seq_len / layout.cp
    d, q, kv = config.d_model, config.n_head * config.head_dim / tp, config.n_kv_head * config.head_dim / tp
    dense = blocks - moe
    attention = (Gemm(tokens, q, d), Gemm(tokens, kv, d, 2), Gemm(tokens, d, q))
    gemms = [Gemm(g.m, g.n, g.k, g.count * blocks, fp8=fp8) for g in attention]
    f = config.d_ff / tp
    gemms += [Gemm(tokens, f, d, 2 * dense, fp8=fp8), Gemm(tokens, d, f, dense, fp8=fp8)] if dense else []
    rows = 0.0
    if moe:  # NOTE: the experts are not split by TP (a replicated region): each rank runs its tokens' experts
        rows = tokens * config.n_expert_per_token
        per_expert = rows / config.n_expert * layout.ep  # rows a rank's expert receives, an even load assumed
        experts = config.n_expert // layout.ep
        fe = config.d_ff_expert
        gemms += [Gemm(tokens, config.n_expert, d, moe)]  # the router
        gemms += [Gemm(per_expert, fe, d, 2 * experts * moe), Gemm(per_expert, d, fe, experts * moe)]
        if config.n_shared_experts:
            shared = config.n_shared_experts * fe
            gemms += [Gemm(tokens, shared, d, 2 * moe, fp8=fp8), Gemm(tokens, d, shared, moe, fp8=fp8)]
            rows += tokens * config.n_shared_experts
    # Norms and residuals see a TP rank's share of the sequence under SP, the whole of it otherwise.
    hidden = tokens * d / (tp if sp else 1)
    kind = 1 if fused else 0
    elementwise = [
        (NORM, 2 * hidden * blocks),
        (RESIDUAL, 2 * hidden * blocks),
        (ROTARY, tokens * (q + kv) * blocks),
        (CONTIGUOUS, tokens * q * blocks),
        (SWIGLU, tokens * f * dense + rows * config.d_ff_expert),
        (ROUTING, rows * d),
    ]
    byte_count = sum(op[kind][0] * elements for op, elements in elementwise)
    kernels = blocks * (2 * NORM[kind][1] + 2 * RESIDUAL[kind][1] + 2 * ROTARY[kind][1] + CONTIGUOUS[kind][1])
    experts = config.n_expert // layout.ep + config.n_shared_experts if moe else 0
    kernels += dense * SWIGLU[kind][1] + moe * (experts * SWIGLU[kind][1] + ROUTING[kind][1])
    vocab = config.vocab_size / tp
    head = (Gemm(tokens, vocab, d, frozen=lora is not None),) if stage.last else ()
    if lora is not None:  # the weights frozen, the adapters beside them
        gemms = [Gemm(g.m, g.n, g.k, g.count, frozen=True) for g in gemms]
        gemms += adapter_gemms(config, lora, tokens, blocks, dense, tp)
    last, first = stage.last, stage.first
    other = (CROSS_ENTROPY[0] * tokens * vocab if last else 0.0) + (EMBEDDING[0] * tokens * d if first else 0.0)
    other_kernels = (CROSS_ENTROPY[1] if last else 0) + (EMBEDDING[1] if first else 0)
    causal = 4 * tokens * seq_len * config.n_head / tp * config.head_dim / 2
    return Work(tuple(gemms), head, causal * blocks, byte_count, kernels, other, other_kernels, blocks, tp > 1)


def adapter_gemms(config: GPTConfig, lora: LoRA, tokens: float, blocks: int, dense: int, tp: int) -> list[Gemm]:
    """The adapters' GEMMs (``A`` then ``B``) per micro-batch: a column-parallel linear's ``B`` and a row-parallel
    one's ``A`` split over TP (latent attention's ``q_a`` and ``kv_a`` neither: `linear_widths`). Left out: an MoE
    layer's expert adapters, rank / d_ff_expert of its experts' GEMMs."""
    gemms = []
    for role in lora.targets:
        count = dense if role in ("gate", "up", "down") else blocks
        inner, outer = linear_widths(config)[role]
        if role in TP_SPLITS_INPUTS:
            inner /= tp
        elif role not in TP_WHOLE:
            outer /= tp
        gemms += [Gemm(tokens, lora.rank, inner, count), Gemm(tokens, outer, lora.rank, count)]
    return [g for g in gemms if g.count]
