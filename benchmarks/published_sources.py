"""Published training runs of the sources besides torchtitan, the Megatron-LM README and llm-foundry (those are in
`benchmarks/published_runs.py`), gathered for issue 50 from the papers, READMEs and vendor tables named in each
``source``. Each run is planned as the source states it; what a source leaves out is assumed, said under the run's
``assumed``, and taken from its framework's documented default (the `Software` stacks below).

Measured values are in the unit the source prints, converted only by arithmetic the source allows: tokens/s per GPU
from a whole job's tokens/s (÷ GPUs) or from a step time (global batch x sequence ÷ step ÷ GPUs); MFU only where
nothing else is printed (Llama 3).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from benchmarks.published_runs import MEGATRON_STACK, Run, swiglu_width
from lit3d.models.config import GPTConfig
from lit3d.planner.calibration import MEGATRON_TP_OVERLAP
from lit3d.planner.hardware import GPUS
from lit3d.planner.inputs import Software

# The groups leave-one-source-out leaves out whole: sources that share an organisation and a software lineage.
META, BIGSCIENCE, ELEUTHER, BYTEDANCE = "Meta (Llama 3)", "BigScience", "EleutherAI", "ByteDance"
NVIDIA, MAXTEXT, AUTOMODEL, IBM, MTNLG = "NVIDIA Megatron/NeMo", "NVIDIA JAX", "NVIDIA AutoModel", "IBM", "MT-NLG"

# Megatron-LM and DeepSpeed before 2023 (BLOOM, GPT-NeoX, MT-NLG, ByteDance's Megatron-LM baseline): attention as two
# batched GEMMs around a fused softmax (no FlashAttention), fused bias-GeLU and layer norm kernels, activations
# sequence first, no TP overlap, and the gradient reduction after the last backward (not overlapped); its
# vocabulary-parallel loss writes its gradient into the fp32 softmax it kept (`loss_grad_bytes`: the bf16 cast).
OLD_MEGATRON = Software(
    attention="unfused",
    fused=True,
    sequence_first=True,
    overlap_grad_reduce=False,
    saved_activations="fused",
    loss_grad_bytes=2,
)
# Megatron-LM of 2023 (ByteDance's baseline) as the above, with gradients held and reduced in bf16 (its default).
MEGATRON_LM_2023 = replace(OLD_MEGATRON, bf16_grads=True)
# NeMo (Megatron-Core with Transformer Engine): as Megatron-Core; FP8 casts fused into the kernels before each GEMM,
# and each FP8 linear keeps its input's FP8 cast for backward (Transformer Engine's Linear and LayerNormLinear save the
# quantized input: its ln_out in FP8).
NEMO = MEGATRON_STACK
NEMO_FP8 = Software(
    attention="cudnn",
    fused=True,
    tp_overlap=MEGATRON_TP_OVERLAP,
    overlap_param_gather=True,
    sequence_first=True,
    fp8_cast_bytes=1.0,
    saved_activations="fused",
    bf16_grads=True,
    fp8_saved_inputs=True,
    loss_grad_bytes=2,
)
# MaxText on XLA: XLA fuses elementwise work (the loss's gradient made once, in bf16); cuDNN's fused attention
# (NVIDIA's JAX container); FP8 casts fused.
MAXTEXT_STACK = Software(
    attention="cudnn", fused=True, fp8_cast_bytes=1.0, saved_activations="compiled", loss_grad_bytes=2
)
# IBM's fms-fsdp: eager PyTorch FSDP with SDPA's FlashAttention-2; fms's selective checkpointing recomputes every
# second block (half the forward's matmuls).
IBM_STACK = Software(attention="flash2")
IBM_SELECTIVE = Software(attention="flash2", recomputed_matmuls=0.5)
# Meta's Llama 3 stack: attention kernel and fusion not stated; assumed FlashAttention-2 and elementwise work fused as a
# compiler fuses it (norm and SwiGLU outputs recomputed in backward: the least a block keeps without recompute).
META_STACK = Software(attention="flash2", fused=True, saved_activations="compiled")
# NeMo AutoModel: Transformer Engine's RMSNorm, linear and attention kernels on eager PyTorch FSDP2; its benchmark's
# loss on the bf16 logits (MaskedCrossEntropy, `fp32_upcast: false`). Its Qwen3 MoE is built in bf16
# (`Qwen3MoeForCausalLM.initialize_weights(dtype=torch.bfloat16)`), so torch.optim.Adam keeps bf16 moments: the run
# plans as bf16-true, its gradients reduced in fp32 (its MoE parallelizer's `reduce_dtype=torch.float32`).
AUTOMODEL_STACK = Software(attention="cudnn", loss_bytes=2, fp32_reduce=True)


def dense(layers: int, hidden: int, heads: int, vocab: int, kv: int | None = None, ff: int | None = None, **more):
    """A decoder of the given shape; ``ff`` None: a 4h MLP (GeLU, squared ReLU) as the SwiGLU of the same weights."""
    return GPTConfig(n_layer=layers, d_model=hidden, n_head=heads, n_kv_head=kv or heads, vocab_size=vocab,
                     d_ff=ff or swiglu_width(hidden), max_seq_len=8192, **more)  # fmt: skip


LLAMA2 = {
    "7b": dense(32, 4096, 32, 32000, ff=11008),
    "13b": dense(40, 5120, 40, 32000, ff=13824),
    "34b": dense(48, 8192, 64, 32000, kv=8, ff=22016),
    "70b": dense(80, 8192, 64, 32000, kv=8, ff=28672),
}
NEMOTRON_340B = dense(96, 18432, 96, 256000, kv=8)
GPT_175B = dense(96, 12288, 128, 64000)  # MegaScale's: 128 heads, vocabulary 64,000


def layout(
    dp: int, tp: int = 1, pp: int = 1, vp: int | None = None, cp: int = 1, ep: int = 1, zero: int = 1, **more: Any
) -> dict[str, Any]:
    """Parallelism fields: interleaved 1F1B where ``vp`` chunks per rank are given, 1F1B where pipelined without."""
    fields = dict(data_parallel_size=dp, tensor_parallel_size=tp, pipeline_parallel_size=pp, context_parallel_size=cp,
                  expert_parallel_size=ep, zero_stage=zero, sequence_parallel=tp > 1)  # fmt: skip
    if pp > 1:
        fields["pipeline_schedule"] = "interleaved_1f1b" if vp else "1f1b"
        if vp:
            fields["virtual_pipeline_size"] = vp
    return {"activation_checkpointing": False, **fields, **more}


def loop(seq: int, batch: int, micro: int, software: Software, **more: Any) -> dict[str, Any]:
    return dict(seq_len=seq, global_batch_size=batch, micro_batch_size=micro, software=software, **more)


def per_gpu(tokens_per_s: float, gpus: int) -> float:
    return tokens_per_s / gpus


def from_step(batch: int, seq: int, step_s: float, gpus: int) -> float:
    return batch * seq / step_s / gpus


H100, A100 = {}, dict(gpu=GPUS["A100"])
LLAMA3 = "Meta, The Llama 3 Herd of Models (arXiv 2407.21783), §3.3.2 Table 4"
LLAMA3_ASSUMED = (
    "micro-batches of one sequence (16M tokens / DP / 8,192); 8 virtual stages per rank with Meta's cut (embedding "
    "and head alone on the first and last chunk); FlashAttention-2 and compiler-fused elementwise kernels (norm and "
    "SwiGLU outputs recomputed in backward: not stated, the least a block keeps without recompute); no TP "
    "overlap; ZeRO-2 as FSDP that keeps parameters between forward and backward; MFU with the planner's FLOP count"
)


def _llama3(dp: int, mfu: float) -> Run:
    return Run(f"Llama 3 405B, DP{dp} x TP8 x PP16", LLAMA3, GPTConfig.load("llama-405b"), dp * 128,
               layout(dp, 8, 16, 8, zero=2), loop(8192, 2048, 1, META_STACK), mfu, "mfu", group=META,
               assumed=LLAMA3_ASSUMED, cluster=H100)  # fmt: skip


BLOOM = "BigScience, bigscience-workshop/bigscience train/tr11-176B-ml README"
BLOOM_ASSUMED = (
    "ALiBi as rotary, the 4h GeLU MLP as a SwiGLU of 8h/3; Megatron-DeepSpeed's unfused attention and fused kernels; "
    "Omni-Path 4 x 100 Gb/s per node (6.25 GB/s per GPU); the tied embeddings counted as blocks (5 blocks on the "
    "first and last stage, each holding a copy of the tied embedding: planned untied); gradients reduced after "
    "backward (DeepSpeed's BF16 optimizer)"
)
BLOOM_RUN = Run(
    "BLOOM 176B, DP8 x TP4 x PP12", BLOOM, dense(70, 14336, 112, 250680), 384,
    layout(8, 4, 12, activation_checkpointing=True, sequence_parallel=False,
           pipeline_stage_layers=[5] + [6] * 10 + [5]),
    loop(2048, 2048, 2, OLD_MEGATRON), from_step(2048, 2048, 104.7, 384), group=BIGSCIENCE, assumed=BLOOM_ASSUMED,
    cluster=dict(gpu=GPUS["A100"], inter_node_gbps=6.25), memory_gb=60.0,
)  # fmt: skip
NEOX = "EleutherAI, GPT-NeoX-20B (arXiv 2204.06745) §3"
NEOX_ASSUMED = (
    "117 TFLOP/s per GPU read as Megatron's hardware FLOPs (recompute counted: 96·L·h²·(1 + s/6h + V/16Lh) per token), "
    "so 688 tokens/s per GPU; the 4h GeLU MLP as a SwiGLU of 8h/3, parallel residual as sequential (same FLOPs); "
    "fp16; four 200 Gb/s HCAs per node (12.5 GB/s per GPU); Megatron's unfused attention"
)
NEOX_RUN = Run(
    "GPT-NeoX 20B, DP12 x TP2 x PP4", NEOX, dense(44, 6144, 64, 50432), 96,
    layout(12, 2, 4, activation_checkpointing=True, sequence_parallel=False),
    loop(2048, 1536, 4, OLD_MEGATRON, precision="16-mixed"), 688.0, group=ELEUTHER, assumed=NEOX_ASSUMED,
    cluster=dict(gpu=GPUS["A100 40GB"], inter_node_gbps=12.5),
)  # fmt: skip
MEGASCALE = "ByteDance, MegaScale (arXiv 2402.15627) Table 2, Megatron-LM baseline"
MEGASCALE_ASSUMED = (
    "A100 80GB (stated: Ampere); the GPT's 4h GeLU MLP as a SwiGLU of 8h/3; micro-batches of one sequence; no "
    "recompute; the distributed optimizer (ZeRO-1), gradients held and reduced in bf16 (Megatron's default); stock "
    "Megatron-LM of 2023 (no FlashAttention, no overlap: MegaScale adds them); eight 200 Gb/s NICs per node (25 GB/s "
    "per GPU)"
)


def _megascale(gpus: int, batch: int, tokens: float) -> Run:
    return Run(f"GPT 175B, {gpus:,} A100, Megatron-LM", MEGASCALE, GPT_175B, gpus, layout(gpus // 64, 8, 8, 6),
               loop(2048, batch, 1, MEGATRON_LM_2023), per_gpu(tokens, gpus), group=BYTEDANCE,
               assumed=MEGASCALE_ASSUMED, cluster=A100)  # fmt: skip


NEMOTRON = "NVIDIA, Nemotron-4 15B Technical Report (arXiv 2402.16819) Table 2"
NEMOTRON_ASSUMED = (
    "squared-ReLU MLP of 4h as a SwiGLU of 8h/3; micro-batches of one sequence; no recompute; NeMo's defaults "
    "(Megatron-Core, Transformer Engine, TP overlap, distributed optimizer, gradients reduced in bf16)"
)


def _nemotron(dp: int, batch: int, step: float) -> Run:
    gpus = dp * 8
    return Run(f"Nemotron-4 15B, DP{dp} x TP8", NEMOTRON, dense(32, 6144, 48, 256000, kv=8), gpus, layout(dp, 8),
               loop(4096, batch, 1, NEMO), from_step(batch, 4096, step, gpus), group=NVIDIA,
               assumed=NEMOTRON_ASSUMED)  # fmt: skip


DGXC = "NVIDIA/dgxc-benchmarking READMEs (NeMo 24.09)"
DGXC_ASSUMED = (
    "NeMo's defaults (Megatron-Core, Transformer Engine, cuDNN attention, TP overlap, the distributed optimizer "
    "overlapped); no recompute (not stated); FP8 as per-tensor scales with casts fused; Nemotron-4's squared-ReLU MLP "
    "of 4h as a SwiGLU of 8h/3; Nemotron-4 340B's optimizer state in bf16, as its config states (below)"
)
# NeMo 24.07 and 24.09 step Nemotron-4 340B with Apex's DistributedFusedAdam holding its state in bf16 (`optim.name:
# distributed_fused_adam`, `dtype: bf16` in NeMo-Framework-Launcher's conf/training/nemotron/nemotron_340b.yaml at
# both tags, and in dgxc's nemotron4-340b-synth.yaml, which its launch script trains); their other models' configs keep
# it in fp32, as NeMo 24.12 switched this one to Megatron-Core's distributed optimizer, which does.
BF16_OPTIMIZER_STATE = (NEMOTRON_340B,)


def _dgxc(name: str, model: GPTConfig, gpus: int, lay: dict, seq: int, batch: int, total: float, fp8=False) -> Run:
    settings = {**lay, "float8": "tensorwise"} if fp8 else lay
    software = replace(NEMO_FP8 if fp8 else NEMO, bf16_optimizer=model in BF16_OPTIMIZER_STATE)
    return Run(f"{name}, {gpus:,} H100" + (", FP8" if fp8 else ""), DGXC, model, gpus, settings,
               loop(seq, batch, 1, software), per_gpu(total, gpus), group=NVIDIA, assumed=DGXC_ASSUMED)  # fmt: skip


LLAMA31_70B, LLAMA_405B = GPTConfig.load("llama3.1-70b"), GPTConfig.load("llama-405b")
DGXC_RUNS = [
    *[_dgxc("Llama 3.1 70B", LLAMA31_70B, g, layout(g // 32, 4, 4, 5, cp=2), 8192, 2 * g, total)
      for g, total in [(64, 71235), (128, 142373), (256, 283399), (512, 563372), (1024, 1124478), (2048, 2248957)]],
    *[_dgxc("Llama 3.1 405B", LLAMA_405B, g, layout(g // 144, 8, 9, 7, cp=2), 8192, g * 7 // 16, total)
      for g, total in [(576, 120022), (1152, 235660), (2304, 468646)]],
    _dgxc("Llama 3.1 405B", LLAMA_405B, 576, layout(4, 8, 9, 7, cp=2), 8192, 252, 183664, fp8=True),
    *[_dgxc("Nemotron-4 340B", NEMOTRON_340B, g, layout(g // 64, 8, 8, 12), 4096, g // 4, total)
      for g, total in [(128, 28432), (256, 56134), (512, 111551), (1024, 221686), (2048, 433296)]],
    _dgxc("Nemotron-4 340B", NEMOTRON_340B, 128, layout(2, 8, 8, 12), 4096, 32, 41478, fp8=True),
]  # fmt: skip

MAXTEXT_SOURCE = "NVIDIA/dgxc-benchmarking maxtext/README_70b.md (JAX MaxText)"
MAXTEXT_ASSUMED = (
    "ZeRO-3 in the README's shard groups (all GPUs up to 256; HSDP's groups of 128, replicas between them, beyond); "
    "full recompute (MaxText's default remat policy; not stated); XLA-fused elementwise work (norm and "
    "SwiGLU outputs recomputed in backward); cuDNN attention; FP8 as per-tensor scales with casts fused"
)


def _maxtext(gpus: int, total: float, fp8: bool = False) -> Run:
    groups = {"data_parallel_shard_size": 128} if gpus > 256 else {}  # (as the README's table states)
    settings = layout(
        gpus, zero=3, activation_checkpointing=True, **groups, **({"float8": "tensorwise"} if fp8 else {})
    )
    return Run(f"Llama 2 70B, FSDP{gpus}" + (", FP8" if fp8 else ""), MAXTEXT_SOURCE, LLAMA2["70b"], gpus, settings,
               loop(4096, 2 * gpus, 2, MAXTEXT_STACK), per_gpu(total, gpus), group=MAXTEXT,
               assumed=MAXTEXT_ASSUMED)  # fmt: skip


MAXTEXT_RUNS = [
    *[_maxtext(g, total) for g, total in
      [(64, 74908.99), (128, 148271.49), (256, 293184.96), (512, 591496.83), (1024, 1184162.62), (2048, 2374358.34)]],
    _maxtext(64, 121250.69, fp8=True),
]  # fmt: skip

# A GB200 GPU's link to its Grace CPU's memory, per direction: NVLink-C2C's 900 GB/s both ways (GB200 datasheet),
# assumed shared by the superchip's two GPUs.
GRACE_C2C = 225.0
# Megatron-Bridge's performance configs (scripts/performance/configs/llama/llama3_workload_base_configs.py, 25.11:
# LLAMA3_70B_PRETRAIN_CONFIG_GB200_FP8_CS) offload the activations of 40 of Llama 3 70B's 80 blocks to host memory.
BRIDGE_70B_GB200_OFFLOADED = 40
NEMO_DOCS = "NVIDIA NeMo 24.07 performance summary"
BRIDGE_DOCS = "NVIDIA Megatron-Bridge 25.11 performance summary"
NEMO_DOCS_ASSUMED = (
    "NeMo's defaults (Megatron-Core, Transformer Engine, cuDNN attention, TP overlap, the distributed optimizer, "
    "gradients reduced in bf16); no recompute (not stated; Bridge's configs of 25.11 set none for these runs); "
    "Bridge's Llama 3 70B on GB200 offloads 40 blocks' activations to the Grace CPU's memory, as its config states; "
    "Bridge's loss is Transformer Engine's cross entropy, as its recipes set; FP8 (delayed or current scaling) as "
    "per-tensor scales with casts fused, each FP8 linear keeping its input's FP8 cast; MoE routing balanced (as the "
    "page states); NeMo 24.07's Nemotron-4 340B with its optimizer state in bf16, as its config states"
)


def _nemo(name: str, source: str, model: GPTConfig, gpus: int, lay: dict, seq: int, batch: int, micro: int,
          tokens: float, fp8: bool = True, gpu: str = "H100", offloaded: int = 0) -> Run:  # fmt: skip
    settings = {**lay, "float8": "tensorwise"} if fp8 else lay
    bridge = source == BRIDGE_DOCS
    version = "Bridge 25.11" if bridge else "NeMo 24.07"
    software = replace(
        NEMO_FP8 if fp8 else NEMO,
        offloaded_layers=offloaded,
        bf16_optimizer=not bridge and model in BF16_OPTIMIZER_STATE,
    )
    if bridge:  # its performance recipes compute the loss with Transformer Engine's cross entropy
        # (`cross_entropy_fusion_impl = "te"`), which keeps the bf16 logits and writes its gradient into them; NeMo
        # 24.07's is Megatron-Core's, as the stacks above
        software = replace(software, loss_bytes=2, loss_grad_bytes=0)
    cluster = dict(gpu=GPUS[gpu], **({"host_link_gbps": GRACE_C2C} if gpu == "GB200" else {}))
    return Run(f"{name}, {gpus} {gpu}" + (", FP8" if fp8 else "") + f" ({version})", source, model, gpus, settings,
               loop(seq, batch, micro, software), tokens, group=NVIDIA, assumed=NEMO_DOCS_ASSUMED,
               cluster=cluster)  # fmt: skip


NEMO_RUNS = [
    _nemo("GPT-3 175B", NEMO_DOCS, GPTConfig.load("gpt3-175b"), 128, layout(4, 4, 8, 6), 2048, 256, 1, 726),
    _nemo("GPT-3 175B", NEMO_DOCS, GPTConfig.load("gpt3-175b"), 512, layout(16, 4, 8, 6), 2048, 2048, 2, 782),
    _nemo("Llama 2 7B", NEMO_DOCS, LLAMA2["7b"], 8, layout(8), 4096, 128, 1, 16847),
    _nemo("Llama 2 70B", NEMO_DOCS, LLAMA2["70b"], 64, layout(4, 4, 4, 20), 4096, 128, 1, 1707),
    _nemo("Llama 3 8B", NEMO_DOCS, GPTConfig.load("llama-8b"), 8, layout(4, cp=2), 8192, 128, 1, 12036),
    _nemo("Llama 3 70B", NEMO_DOCS, GPTConfig.load("llama-70b"), 64, layout(2, 4, 4, 5, cp=2), 8192, 128, 1, 1533),
    _nemo("Nemotron-4 340B", NEMO_DOCS, NEMOTRON_340B, 128, layout(2, 8, 8, 12), 4096, 32, 1, 322),
    _nemo("Llama 3 8B, FSDP8", BRIDGE_DOCS, GPTConfig.load("llama-8b"), 8, layout(8, zero=3), 8192, 128, 1, 14451),
    _nemo("Llama 3.1 405B", BRIDGE_DOCS, LLAMA_405B, 1024, layout(8, 8, 8, 8, cp=2), 8192, 512, 1, 292),
    _nemo("Qwen3 30B-A3B", BRIDGE_DOCS, GPTConfig.load("qwen3-30b-a3b"), 16, layout(8, 1, 2, 24, ep=8), 4096, 512,
          2, 5275),
    _nemo("Llama 3.1 405B", BRIDGE_DOCS, LLAMA_405B, 128, layout(2, 4, 8, 8, cp=2), 8192, 64, 1, 661, gpu="B200"),
    _nemo("Llama 3 70B, FSDP64", BRIDGE_DOCS, GPTConfig.load("llama-70b"), 64, layout(64, zero=3), 8192, 256, 2, 4312,
          gpu="GB200", offloaded=BRIDGE_70B_GB200_OFFLOADED),
]  # fmt: skip

AUTOMODEL_RUN = Run(
    "Qwen3 30B-A3B, FSDP8 x EP8", "NVIDIA NeMo AutoModel docs/performance-summary.md",
    GPTConfig.load("qwen3-30b-a3b"), 8,
    layout(8, ep=8, zero=3, activation_checkpointing=True),
    loop(4096, 512, 4, AUTOMODEL_STACK, precision="bf16-true"), 12040,
    group=AUTOMODEL,
    assumed="full recompute as its config states (examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml: "
    "activation_checkpointing: true); weights, gradients and Adam's moments in bf16, gradients reduced in fp32, as "
    "its code builds and wraps the model; Transformer Engine's norm and attention kernels on eager PyTorch; routing "
    "balanced (as the page states); DeepEP's all-to-all priced as NCCL's",
)  # fmt: skip

IBM_SOURCE = "IBM foundation-model-stack/fms-fsdp README"
IBM_ASSUMED = (
    "sequence length 4,096 (the README's context length); Llama 2's shapes (34B: Code Llama 34B's); one micro-batch "
    "per step (no accumulation stated); HSDP planned as ZeRO-3 over all GPUs; bf16; 400 Gb/s per A100 node and "
    "800 Gb/s per H100 node as the README states (6.25 and 12.5 GB/s per GPU); selective AC as every second block"
)


def _ibm(size: str, gpus: int, micro: int, recompute: Any, tokens: float) -> Run:
    gpu = dict(gpu=GPUS["A100"], inter_node_gbps=6.25) if gpus == 128 else dict(inter_node_gbps=12.5)
    software = IBM_SELECTIVE if recompute == "selective" else IBM_STACK
    return Run(f"Llama 2 {size}, FSDP{gpus} {'A100' if gpus == 128 else 'H100'}", IBM_SOURCE, LLAMA2[size], gpus,
               layout(gpus, zero=3, activation_checkpointing=recompute), loop(4096, gpus * micro, micro, software),
               tokens, group=IBM, assumed=IBM_ASSUMED, cluster=gpu)  # fmt: skip


IBM_RUNS = [
    _ibm("7b", 128, 2, False, 3760),
    _ibm("13b", 128, 1, False, 1700),
    _ibm("34b", 128, 8, True, 772),
    _ibm("70b", 128, 6, True, 380),
    _ibm("7b", 96, 2, False, 7500),
    _ibm("13b", 96, 2, "selective", 3800),
    _ibm("34b", 96, 2, True, 1550),
]
MTNLG_SOURCE = "Microsoft & NVIDIA, MT-NLG 530B (arXiv 2201.11990) §2.4, as transcribed by cli99/llm-analysis"
MTNLG_ASSUMED = (
    "micro-batches of one sequence; full recompute; the 4h GeLU MLP as a SwiGLU of 8h/3; DeepSpeed's ZeRO-1 with "
    "the gradient reduction after backward; Megatron's unfused attention; 1F1B; eight 200 Gb/s HDR links per node"
)


def _mtnlg(dp: int, step: float) -> Run:
    gpus = dp * 280
    return Run(f"MT-NLG 530B, DP{dp} x TP8 x PP35", MTNLG_SOURCE, dense(105, 20480, 128, 50272), gpus,
               layout(dp, 8, 35, activation_checkpointing=True, sequence_parallel=False),
               loop(2048, 1920, 1, OLD_MEGATRON), from_step(1920, 2048, step, gpus), group=MTNLG,
               assumed=MTNLG_ASSUMED, cluster=A100)  # fmt: skip


OTHER_SOURCES = [
    _llama3(64, 0.43),
    _llama3(128, 0.41),
    BLOOM_RUN,
    NEOX_RUN,
    *[_megascale(g, b, t) for g, b, t in [(256, 768, 39300), (512, 768, 74100), (768, 768, 103800),
      (1024, 768, 132700), (3072, 6144, 433600), (6144, 6144, 851600), (8192, 6144, 1027900), (12288, 6144, 1466800)]],
    *[_nemotron(dp, batch, step) for dp, batch, step in [(96, 384, 0.57), (192, 768, 0.58), (288, 1152, 0.64)]],
    *DGXC_RUNS,
    *MAXTEXT_RUNS,
    *NEMO_RUNS,
    AUTOMODEL_RUN,
    *IBM_RUNS,
    _mtnlg(8, 60.1),
    _mtnlg(10, 50.2),
    _mtnlg(12, 44.4),
]  # fmt: skip
