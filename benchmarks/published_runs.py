"""Published bf16 training runs on H100s, as the planner is asked them: the model, the cluster, the loop's numbers,
the layout and how the run's kernels were written. `planner_vs_published.py` prints the planner's clock beside them.

``CALIBRATION``: the runs the clock's fitted constants (`lit3d.planner.calibration`) were chosen on: the issue's nine,
and the two vanilla-TP runs that torchtitan's async-TP runs were measured against (what async TP hides is their
difference).
``HELD_OUT``: other rows of the same sources, not used to choose them. What a source leaves out is assumed, and said
under ``assumed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lit3d.models.config import GPTConfig
from lit3d.planner.calibration import ASYNC_TP, MEGATRON_TP_OVERLAP
from lit3d.planner.hardware import GPUS
from lit3d.planner.inputs import Software

TORCHTITAN_2412 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TORCHTITAN_ASYNC = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
MEGATRON = "Megatron-LM README, weak scaling (images/model_table.png)"
FOUNDRY = "llm-foundry scripts/train/benchmarking/README.md"
# The source groups of these sources: the Megatron-LM README is NVIDIA's, as NeMo's tables are.
GROUPS = {TORCHTITAN_2412: "torchtitan", TORCHTITAN_ASYNC: "torchtitan", MEGATRON: "NVIDIA Megatron/NeMo",
          FOUNDRY: "MosaicML llm-foundry"}  # fmt: skip

# torchtitan's Grand Teton hosts: H100s with 96 GB of HBM2e at 2.4 TB/s, at the default 500 W limit (both files).
GRAND_TETON = dict(gpu=GPUS["H100 96GB"], power_watts=500.0)
# torchtitan: SDPA's flash backend (FlashAttention-2) on H100; per-op selective recompute saves every matmul output
# but every second one, and the attention output.
TITAN_ASSUMED = (
    "H100s of 96 GB HBM2e at 2.4 TB/s run at 500 W (as published); sequence length 8,192 (the train configs); SDPA's "
    "flash backend (FlashAttention-2); per-op selective recompute as every second matmul; FSDP2 gathering bf16, "
    "reducing fp32"
)
TITAN = Software(attention="flash2", recomputed_matmuls=0.5)
TITAN_COMPILED = Software(attention="flash2", fused=True, recomputed_matmuls=0.5)
TITAN_ASYNC_TP = Software(attention="flash2", fused=True, tp_overlap=ASYNC_TP, recomputed_matmuls=0.5)
TITAN_TP = Software(attention="flash2", fused=True, recomputed_matmuls=0.5)
# Megatron-Core (r0.8): Transformer Engine's fused kernels and cuDNN attention (assumed: not stated), TP communication
# overlap, the distributed optimizer with gradient reduction and weight gathers overlapped, activations laid out
# sequence first, gradients held and reduced in bf16 (``grad_reduce_in_fp32`` off, its default), its
# vocabulary-parallel loss writing its gradient into the fp32 softmax it kept (then a bf16 cast for the head).
MEGATRON_STACK = Software(
    attention="cudnn",
    fused=True,
    tp_overlap=MEGATRON_TP_OVERLAP,
    overlap_param_gather=True,
    sequence_first=True,
    saved_activations="fused",
    bf16_grads=True,
    loss_grad_bytes=2,
)
MEGATRON_ASSUMED = (
    "DGX H100s at 700 W, bf16 (MFU against the bf16 peak), gradients held and reduced in bf16 (Megatron's default), "
    "micro-batches of one sequence where pipelined (else the replica's whole batch, no accumulation), no recompute, "
    "the distributed optimizer (ZeRO-1), interleaved 1F1B at 2 chunks per rank where pipelined, cuDNN attention; "
    "GPT's 4h GeLU MLP as a SwiGLU of 8h/3 (the same weights and FLOPs)"
)
# llm-foundry (2023): MPT's Triton flash attention (counted as FlashAttention-2), FSDP FULL_SHARD, no compile; its
# low-precision LayerNorms keep input and output in bf16, its GeLU MLP its 4h input and output: what `fused` counts.
FOUNDRY_STACK = Software(attention="flash2", saved_activations="fused")
FOUNDRY_ASSUMED = (
    "MPT's 4d GeLU MLP as a SwiGLU of 8d/3, ALiBi as rotary, its Triton attention as FlashAttention-2, FSDP gathering "
    "bf16 and reducing fp32 (composer's DEFAULT), links of a DGX H100 (not stated)"
)


@dataclass(frozen=True)
class Run:
    """One published run: what the planner is asked, and what was measured (``tokens``: tokens/s per GPU, or
    ``mfu``: model FLOPs utilisation against 989 TFLOP/s)."""

    name: str
    source: str
    model: GPTConfig
    gpus: int
    layout: dict[str, Any]  # Parallelism fields
    loop: dict[str, Any]  # Training fields
    measured: float
    unit: str = "tokens"  # or "mfu"
    cluster: dict[str, Any] = field(default_factory=dict)  # Cluster fields besides nodes (e.g. the power cap)
    assumed: str = TITAN_ASSUMED
    group: str = ""  # the source group leave-one-source-out leaves out whole; "": as the source's (`GROUPS`)
    memory_gb: float | None = None  # the memory per GPU the source publishes, if it does

    @property
    def source_group(self) -> str:
        return self.group or next(group for source, group in GROUPS.items() if self.source.startswith(source))


def llama(name: str) -> GPTConfig:
    return GPTConfig.load(name)


def swiglu_width(hidden: int) -> int:
    """A SwiGLU width holding the weights of a 4h GeLU MLP (8h/3), rounded up to a multiple of 64."""
    return -(-8 * hidden // (3 * 64)) * 64


def gpt(layers: int, hidden: int, heads: int) -> GPTConfig:
    """Megatron's GPT of the weak-scaling table: multi-head attention, vocabulary 131,072, untied."""
    return GPTConfig(n_layer=layers, n_head=heads, n_kv_head=heads, d_model=hidden, d_ff=swiglu_width(hidden),
                     vocab_size=131072, max_seq_len=4096)  # fmt: skip


def mpt(layers: int, hidden: int, heads: int) -> GPTConfig:
    """MPT: multi-head attention, vocabulary 50,368, tied embeddings."""
    return GPTConfig(n_layer=layers, n_head=heads, n_kv_head=heads, d_model=hidden,
                     d_ff=swiglu_width(hidden), vocab_size=50368, max_seq_len=8192, tie_embeddings=True)  # fmt: skip


def _fsdp(dp: int, ac: Any, compile: bool = False, tp: int = 1) -> dict[str, Any]:
    return dict(data_parallel_size=dp, tensor_parallel_size=tp, pipeline_parallel_size=1, zero_stage=3,
                activation_checkpointing=ac, compile=compile)  # fmt: skip


def _megatron(tp: int, pp: int) -> dict[str, Any]:
    schedule = dict(pipeline_schedule="interleaved_1f1b", virtual_pipeline_size=2) if pp > 1 else {}
    return dict(data_parallel_size=48, tensor_parallel_size=tp, pipeline_parallel_size=pp, zero_stage=1,
                activation_checkpointing=False, **schedule)  # fmt: skip


def _titan(seq: int, batch: int, micro: int, software: Software) -> dict[str, Any]:
    return dict(seq_len=seq, global_batch_size=batch, micro_batch_size=micro, software=software)


def _megatron_loop(batch: int, pp: int) -> dict[str, Any]:
    """Micro-batches of one sequence where pipelined, else the replica's whole batch (no accumulation)."""
    micro = 1 if pp > 1 else batch // 48
    return dict(seq_len=4096, global_batch_size=batch, micro_batch_size=micro, software=MEGATRON_STACK)


def _foundry(seq: int, batch: int, micro: int) -> dict[str, Any]:
    return dict(seq_len=seq, global_batch_size=batch, micro_batch_size=micro, software=FOUNDRY_STACK)


SELECTIVE, FULL = "selective", True
CALIBRATION = [
    Run("Llama 3.1 8B, FSDP8", f"{TORCHTITAN_2412}, Table 1", llama("llama-8b"), 8, _fsdp(8, SELECTIVE),
        _titan(8192, 16, 2, TITAN), 5762, cluster=GRAND_TETON),
    Run("Llama 3.1 8B, FSDP128, compile", f"{TORCHTITAN_2412}, Table 3", llama("llama-8b"), 128,
        _fsdp(128, SELECTIVE, True), _titan(8192, 256, 2, TITAN_COMPILED), 6514, cluster=GRAND_TETON),
    Run("Llama 3.1 8B, FSDP8 x TP8, async TP", TORCHTITAN_ASYNC, llama("llama-8b"), 64, _fsdp(8, SELECTIVE, True, 8),
        _titan(8192, 96, 12, TITAN_ASYNC_TP), 4809.4, cluster=GRAND_TETON),
    Run("Llama 3.1 70B, FSDP32 x TP8, async TP", TORCHTITAN_ASYNC, llama("llama-70b"), 256,
        _fsdp(32, FULL, True, 8), _titan(8192, 512, 16, TITAN_ASYNC_TP), 652.4, cluster=GRAND_TETON),
    Run("GPT 1.7B, DP48", MEGATRON, gpt(24, 2048, 16), 48, _megatron(1, 1), _megatron_loop(192, 1), 0.41, "mfu",
        assumed=MEGATRON_ASSUMED),
    Run("GPT 70B, TP8 x PP2 x DP48", MEGATRON, gpt(84, 8192, 64), 768, _megatron(8, 2), _megatron_loop(384, 2), 0.42,
        "mfu", assumed=MEGATRON_ASSUMED),
    Run("GPT 462B, TP8 x PP16 x DP48", MEGATRON, gpt(112, 18432, 144), 6144, _megatron(8, 16),
        _megatron_loop(3072, 16), 0.47, "mfu", assumed=MEGATRON_ASSUMED),
    Run("MPT-7B, FSDP8", FOUNDRY, mpt(32, 4096, 32), 8, _fsdp(8, False), _foundry(2048, 48, 6), 10643,
        assumed=FOUNDRY_ASSUMED),
    Run("MPT-70B, FSDP64", FOUNDRY, mpt(80, 8192, 64), 64, _fsdp(64, FULL), _foundry(2048, 2048, 8), 1039,
        assumed=FOUNDRY_ASSUMED),
    Run("Llama 3.1 8B, FSDP8 x TP8", TORCHTITAN_ASYNC, llama("llama-8b"), 64, _fsdp(8, SELECTIVE, True, 8),
        _titan(8192, 96, 12, TITAN_TP), 4378, cluster=GRAND_TETON),
    Run("Llama 3.1 70B, FSDP32 x TP8", TORCHTITAN_ASYNC, llama("llama-70b"), 256, _fsdp(32, FULL, True, 8),
        _titan(8192, 512, 16, TITAN_TP), 597.3, cluster=GRAND_TETON),
]  # fmt: skip

HELD_OUT = [
    Run("Llama 3.1 8B, FSDP8, compile", f"{TORCHTITAN_2412}, Table 1", llama("llama-8b"), 8,
        _fsdp(8, SELECTIVE, True), _titan(8192, 16, 2, TITAN_COMPILED), 6667, cluster=GRAND_TETON),
    Run("Llama 3.1 8B, FSDP128", f"{TORCHTITAN_2412}, Table 3", llama("llama-8b"), 128, _fsdp(128, SELECTIVE),
        _titan(8192, 256, 2, TITAN), 5605, cluster=GRAND_TETON),
    Run("GPT 7.1B, TP2 x DP48", MEGATRON, gpt(30, 4096, 32), 96, _megatron(2, 1), _megatron_loop(192, 1), 0.47, "mfu",
        assumed=MEGATRON_ASSUMED),
    Run("GPT 16B, TP4 x DP48", MEGATRON, gpt(32, 6144, 48), 192, _megatron(4, 1), _megatron_loop(192, 1), 0.49, "mfu",
        assumed=MEGATRON_ASSUMED),
    Run("GPT 32B, TP8 x DP48", MEGATRON, gpt(48, 7168, 56), 384, _megatron(8, 1), _megatron_loop(192, 1), 0.46, "mfu",
        assumed=MEGATRON_ASSUMED),
    Run("GPT 119B, TP8 x PP4 x DP48", MEGATRON, gpt(92, 10240, 80), 1536, _megatron(8, 4), _megatron_loop(768, 4),
        0.43, "mfu", assumed=MEGATRON_ASSUMED),
    Run("GPT 177B, TP8 x PP6 x DP48", MEGATRON, gpt(96, 12288, 96), 2304, _megatron(8, 6), _megatron_loop(1152, 6),
        0.44, "mfu", assumed=MEGATRON_ASSUMED),
    Run("GPT 314B, TP8 x PP8 x DP48", MEGATRON, gpt(96, 16384, 128), 3072, _megatron(8, 8), _megatron_loop(1536, 8),
        0.48, "mfu", assumed=MEGATRON_ASSUMED),
    Run("MPT-7B, FSDP128", FOUNDRY, mpt(32, 4096, 32), 128, _fsdp(128, False), _foundry(2048, 768, 6), 10475,
        assumed=FOUNDRY_ASSUMED),
    Run("MPT-7B, FSDP8, seq 8192", FOUNDRY, mpt(32, 4096, 32), 8, _fsdp(8, FULL), _foundry(8192, 128, 8), 6935,
        assumed=FOUNDRY_ASSUMED),
    Run("MPT-13B, FSDP8", FOUNDRY, mpt(40, 5120, 40), 8, _fsdp(8, False), _foundry(2048, 16, 2), 4792,
        assumed=FOUNDRY_ASSUMED),
    Run("MPT-30B, FSDP32", FOUNDRY, mpt(48, 7168, 64), 32, _fsdp(32, FULL), _foundry(2048, 1344, 14), 2308,
        assumed=FOUNDRY_ASSUMED),
    Run("MPT-70B, FSDP128", FOUNDRY, mpt(80, 8192, 64), 128, _fsdp(128, FULL), _foundry(2048, 1024, 8), 1058,
        assumed=FOUNDRY_ASSUMED),
    Run("MPT-1B, ZeRO-2 x 128", FOUNDRY, mpt(24, 2048, 16), 128, {**_fsdp(128, False), "zero_stage": 2},
        _foundry(2048, 1536, 12), 44123, assumed=FOUNDRY_ASSUMED),
]  # fmt: skip
