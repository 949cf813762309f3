"""The planner's clock constants, in one place, each with where it comes from.

Three kinds: a datasheet or a published measurement (a kernel benchmark, nccl-tests), physics (how power bounds
clocks), and a fit to published runs (named "fit": one value for every run and every source). The four of Hopper
were fitted in 2025 to the calibration runs of torchtitan, Megatron-LM and llm-foundry; on the 86 runs of 11 source
groups of `benchmarks/planner_vs_published.py` they err less (median 5 %) than the values ``--fit`` finds on all of
them, and ``--loso`` judges the fit by leave-one-source-out. What differs between software stacks is not here but in
the run's `lit3d.planner.inputs.Software`. A device's efficiencies are in `Efficiencies` (hardware.py gives each GPU
its architecture's); what the clock assumes of any device is below them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Efficiencies:
    """How close a device's kernels come to its datasheet numbers.

    Attributes:
        gemm: Share of the dense peak that a large GEMM sustains at the rated board power.
        gemm_half_dim: A GEMM's efficiency is ``gemm · k / (k + gemm_half_dim)``, ``k`` its inner (reduced)
            dimension: each output tile's loads, stores and pipeline fill are paid once for ``k`` steps of work.
        attention: ``(kernel, forward, backward)``: the share of the peak each attention kernel reaches on its
            causal FLOPs (the first is the fallback for a kernel not named).
        memory: Share of the memory bandwidth a streaming (elementwise) kernel reaches.
        kernel_overhead_us: Time per kernel on top of its work (launch and tail; on a CPU, the operator's dispatch).
        overlap_cost: Share of a collective's time hidden behind compute that still slows that compute (its kernels
            take cores and memory bandwidth from it).
        link: Share of a link's rated bandwidth that ring collectives reach.
        step_overhead_ms: Time per optimizer step besides its kernels: the host's work between steps (the loader's
            next batch, the loss read back for logging, the optimizer's and clipping's launches).
        split_linear_us: The host's time per tensor-parallel linear (forward and backward) beyond a plain one's
            (DTensor's sharding propagation): on a GPU it runs ahead of the kernels (0); on a CPU it adds.
    """

    gemm: float
    gemm_half_dim: float
    attention: tuple[tuple[str, float, float], ...]
    memory: float
    kernel_overhead_us: float
    overlap_cost: float
    link: float
    step_overhead_ms: float
    split_linear_us: float = 0.0

    def attention_efficiency(self, kernel: str) -> tuple[float, float]:
        """(forward, backward) share of the peak of ``kernel``, or of the first kernel listed."""
        for name, forward, backward in self.attention:
            if name == kernel:
                return forward, backward
        return self.attention[0][1:]


# NVIDIA Hopper (H100, H200).
HOPPER = Efficiencies(
    # fit. Alone, a bf16 GEMM of the best shape reaches 0.80 of 989 TFLOP/s on an H100 SXM (ml-engineering's MAMF
    # table: 794.5); inside a training step, with the rest of the step drawing power and memory bandwidth beside it,
    # the fit puts a long-k GEMM at 0.675.
    gemm=0.675,
    # fit: a GEMM of k = 4,096 runs at 0.96 of a long one, k = 1,024 at 0.85, k = 512 at 0.75. (Above ~230 an outer
    # product, k = 1, would price as compute-bound rather than bandwidth-bound: `--fit` tries values up to 200.)
    gemm_half_dim=175.0,
    # flash-attention's own figures, H100 80GB SXM5 (700 W), bf16, head dim 128, causal, 8k tokens, FLOPs counted
    # causal (halved): FlashAttention-2 forward 333 TFLOP/s, forward + backward 308 (so backward ~299:
    # assets/flash2_h100_fwd_bwd_benchmark.png); forward of cuDNN 529 and FlashAttention-3 602
    # (assets/flash3_fp16_fwd.png, the FlashAttention-3 paper). Backward of cuDNN and FlashAttention-3: 518 and 559
    # (the paper, non-causal), taken ~10 % lower for causal masking as FlashAttention-2's forward is.
    attention=(("flash2", 0.337, 0.302), ("cudnn", 0.535, 0.47), ("flash3", 0.61, 0.51), ("unfused", 0.07, 0.07)),
    # STREAM-like copies on an H100 SXM reach ~3.0 of 3.35 TB/s (published microbenchmarks, e.g. Chips and Cheese).
    memory=0.88,
    # A kernel launch and its tail: 2-5 us measured on Hopper (CUDA launch latency microbenchmarks).
    kernel_overhead_us=4.0,
    # fit
    overlap_cost=0.25,
    # nccl-tests on DGX H100: all-gather / reduce-scatter bus bandwidth ~360-370 GB/s of NVLink's 450 per direction,
    # and ~44 of 50 GB/s over 400 Gb/s InfiniBand per GPU: ~0.82-0.88; one value for both.
    link=0.82,
    # fit
    step_overhead_ms=35.0,
)
# NVIDIA Ampere (A100): FlashAttention-2 paper (Dao 2023), A100: forward up to ~73 % of peak (230 TFLOP/s),
# backward ~63 % on long causal sequences; cuBLAS large bf16 GEMMs ~0.8 of 312 TFLOP/s.
AMPERE = Efficiencies(0.80, 128.0, (("flash2", 0.70, 0.58), ("unfused", 0.11, 0.11)), 0.88, 4.0, 0.25, 0.82, 30.0)
# "unfused" attention (two batched GEMMs around a fused softmax, Megatron-LM before FlashAttention), counted: each
# score costs 4 · 128 FLOPs (both GEMMs, head dim 128) at about half the GEMM peak (their inner dimension is 128) and 8
# bytes (written by the first GEMM, read and written by the softmax, read by the second) at the memory bandwidth;
# every score is computed and only the causal half counted: ~0.11 of the peak on an A100, ~0.07 on an H100 (its
# FLOPs grew 3.2x over the A100's, its bandwidth 1.6x).
# NVIDIA Blackwell (B200, GB200), Ada (L40S) and AMD CDNA3 (MI300X): no calibration run; Hopper's numbers stated as
# the assumption.
BLACKWELL = HOPPER
ADA = AMPERE
CDNA3 = HOPPER
# One process of a CPU rehearsal, before `lit3d calibrate` measures the machine: oneDNN fp32 GEMMs at ~0.7 of an
# AVX2 core's peak, PyTorch's CPU attention as a GEMM, ~15 us of dispatch per operator (eager PyTorch), collectives
# (gloo) on the same cores as the compute.
CPU = Efficiencies(0.7, 32.0, (("sdpa", 0.5, 0.4),), 0.7, 15.0, 1.0, 0.5, 10.0)

# Physics: dynamic power goes as f · V², and V as f, so as f³ above a static share; a power cap below the rated
# board power lowers the tensor-core clock to (cap - static)^(1/3) of the rated one's. The static share (idle power
# of an H100 SXM is ~70-100 W of its 700 W) is an assumption.
STATIC_POWER_SHARE = 0.15

# Elementwise backward moves about twice the bytes of its forward (reads the saved input and the incoming gradient,
# writes the input's gradient; a product's backward writes two). Counted, not fit.
BACKWARD_ELEMENTWISE = 2.0
# FlashAttention's backward runs 5 matmuls of the forward's 2 (2.5x its FLOPs): FlashAttention-2 paper.
ATTENTION_BACKWARD_FLOPS = 2.5
# FP8 training's dynamic casts, per element of a GEMM operand (torchao's float8, eager): its amax read (2 bytes), then
# read again, scaled and written in one byte (3). Counted, not fit (no GPU was at hand to fit it against).
FP8_CAST_BYTES = 5
# The share of tensor-parallel traffic hidden behind the GEMMs by torchtitan's async TP (the all-gather and the
# reduce-scatter decomposed into steps that overlap the matmul's chunks): fit (2025, on torchtitan's published speedups
# over vanilla TP, 1.10 for 8B and 1.09 for 70B; the fit predicts 1.04), an input of torchtitan's stack that
# leave-one-source-out holds (no other source runs async TP).
ASYNC_TP = 0.3
# The same by Megatron's TP communication overlap (Transformer Engine's userbuffers, copy engines): all of it (the fit
# of 2025 reached the bound), an input of Megatron-Core's stack.
MEGATRON_TP_OVERLAP = 1.0
# AdamW as PyTorch's foreach implementation runs it: bytes per stepped fp32 parameter (parameter, gradient and two
# moments read, written through ~10 passes) and operators per tensor; plus clipping's norm and scale.
OPTIMIZER_BYTES = 84 + 12
OPTIMIZER_OPS = 12
