"""What a plan is asked and what it answers: the cluster, the training loop's numbers, the bytes each precision holds,
and the `Plan` of one layout (`lit3d.planner.estimate` computes it). Pure values: no torch, no Lightning."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Any

from lit3d.models.lora_settings import LoRA
from lit3d.models.optimizer_settings import OPTIMIZERS
from lit3d.parallel.layout import Layout
from lit3d.parallel.precision import is_bf16_mixed
from lit3d.parallel.schedules import SCHEDULES
from lit3d.parallel.settings import Parallelism
from lit3d.parallel.zero import ZeroPolicy
from lit3d.planner.hardware import GPU, GPUS
from lit3d.planner.tensors import config_key

GB = 1e9
# How far a run's measured peak may pass its plan: every layout of the suite peaks within 1.3x of it (the layouts that
# split the model; plain data parallelism within 1.25x: tests/test_plan_check.py). `3d_auto` plans within the usable
# memory divided by it, and a run that passes it (or its usable memory) is told so
# (`lit3d.strategies.telemetry.plan_check`).
PEAK_BAND = 1.3


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter held as weights, gradients and optimizer state, and per stored activation; and per
    element on the wire: ``gathered`` for FSDP's parameter gathers, ``reduced`` for gradient reductions (default:
    as held); ``stepped``: of the tensors the optimizer steps (default: the weights; fp32 master weights)."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    gathered: int | None = None
    reduced: int | None = None
    stepped: int | None = None
    frozen: int | None = None  # a frozen weight (LoRA's base), if not held as the trained ones

    @property
    def frozen_bytes(self) -> int:
        return self.weights if self.frozen is None else self.frozen

    @property
    def gather_bytes(self) -> int:
        return self.weights if self.gathered is None else self.gathered

    @property
    def reduce_bytes(self) -> int:
        return self.grads if self.reduced is None else self.reduced

    @property
    def stepped_bytes(self) -> int:
        return self.weights if self.stepped is None else self.stepped


# Bytes per element a lit3d run holds and sends, by Lightning's precision: the one table both the search and the run's
# own estimate (`lit3d.planner.run.plan_of_run`) read, through `held_precision`.
PRECISIONS = {
    "32-true": Precision(4, 4, 8, 4),  # fp32 everything; AdamW's two moments
    "bf16-true": Precision(2, 2, 4, 2),
    # fp32 parameters computed in bf16 (`lit3d.strategies.optim.dtypes`): FSDP2's shards gathered in bf16, DDP's
    # replicas cast by autocast (its bf16 copies are activations: `autocast_weight_bytes`); gradients reduced in fp32.
    "bf16-mixed": Precision(4, 4, 8, 2, gathered=2, reduced=4),
    "16-mixed": Precision(4, 4, 8, 2),
}
# ZeRO-1 under bf16-mixed (`keeps_master_weights`): bf16 parameters; in the optimizer's slices the fp32 master weights,
# both moments and the fp32 gradient; the updated slices all-gathered in bf16. Megatron's distributed optimizer:
# 2 + (4 + 12) / D bytes per parameter.
# Frozen weights (LoRA's base) are not the optimizer's, so they stay fp32 there, and autocast casts them.
MASTER_WEIGHTS = Precision(2, 4, 12, 2, gathered=2, reduced=4, stepped=4, frozen=4)


@dataclass
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gb: float = 85.0  # an H100's, as PyTorch reports it (`lit3d.planner.hardware`)
    intra_node_gbps: float = 450.0  # NVLink, GB/s per direction
    inter_node_gbps: float = 50.0  # InfiniBand share of one GPU, GB/s
    peak_tflops: float = 989.0  # dense bf16
    # The α of the α-β model, from NCCL's own tuning model (src/graph/tuning.cc, ring algorithm, Simple protocol):
    # a base latency per collective and a hardware latency per ring hop, over NVLink and over the network.
    collective_latency_us: float = 8.4
    intra_node_hop_us: float = 5.7
    inter_node_hop_us: float = 6.6
    # The link between DiLoCo's islands (datacenters), per GPU as the links above: about a hundredth of InfiniBand's
    # bandwidth, and milliseconds of latency per hop.
    inter_island_gbps: float = 1.0
    inter_island_latency_ms: float = 10.0
    device: str = "GPU"  # what the reports call one rank's device ("CPU process" for a rehearsal on CPU)
    # The device the clock prices kernels on: its memory bandwidth, rated power and kernel efficiencies (the numbers
    # above replace its own); and the power cap its boards run at, if below the rated power.
    gpu: GPU = field(default_factory=lambda: GPUS["H100"])
    power_watts: float | None = None
    # Offload (ZeRO-3's states in host memory): each GPU's link to host memory (PCIe Gen5 x16 with pinned buffers,
    # about half its rated 64 GB/s reached), and the parameters per second (billions) AdamW steps on its share of the
    # host's cores: PyTorch's foreach AdamW steps 0.25 G/s per core (benchmarks/finetune.py measures it), 8 cores.
    host_link_gbps: float = 25.0
    host_adamw_gparams: float = 2.0
    # A fleet's pipeline (`lit3d.planner.fleet`): the GPU of each pipeline rank, whose peak, memory, bandwidth and
    # NVLink (its TP traffic's) price that stage, the other links staying the numbers above; None: all are ``gpu``.
    stage_gpus: tuple[GPU, ...] | None = None

    @classmethod
    def of(cls, gpu: GPU, nodes: int = 1, gpus_per_node: int = 8, **numbers: Any) -> Cluster:
        """``nodes`` x ``gpus_per_node`` of ``gpu``, with its memory, peak and links (``numbers`` replace them)."""
        own = dict(
            gpu_memory_gb=gpu.memory_gb,
            intra_node_gbps=gpu.intra_node_gbps,
            peak_tflops=gpu.peak_tflops,
            inter_node_gbps=gpu.inter_node_gbps,
            device=gpu.device,
        )
        return cls(nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu, **{**own, **numbers})

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def stage(self, rank: int) -> Cluster:
        """The cluster pipeline rank ``rank`` runs on: a fleet's stage its own GPU, its peak, memory and NVLink."""
        if self.stage_gpus is None:
            return self
        gpu = self.stage_gpus[rank]
        return replace(
            self,
            gpu=gpu,
            peak_tflops=gpu.peak_tflops,
            gpu_memory_gb=gpu.memory_gb,
            intra_node_gbps=gpu.intra_node_gbps,
            stage_gpus=None,
        )


@dataclass(frozen=True)
class Software:
    """How the run's kernels are written, where the clock needs to know (the defaults: a lit3d run).

    Attributes:
        attention: The attention kernel: ``flash2`` (the flash-attn package, PyTorch SDPA's flash backend),
            ``cudnn`` (cuDNN's fused attention, Transformer Engine's), ``flash3`` (FlashAttention-3), ``unfused`` (two
            batched GEMMs around a softmax that writes the scores out: Megatron-LM and DeepSpeed before
            FlashAttention); on a CPU, ``sdpa``.
        fused: Elementwise work fused into a few kernels per block (``torch.compile``, Transformer Engine's fused
            kernels); None: as the run's ``compile``.
        tp_overlap: The share of tensor-parallel traffic hidden behind the GEMMs: torchtitan's async TP
            (`lit3d.planner.calibration.ASYNC_TP`), Megatron's TP communication overlap (``MEGATRON_TP_OVERLAP``); lit3d
            runs them in turn (0).
        overlap_param_gather: ZeRO-1's gather of the updated weights overlapped with the next forward (Megatron's
            distributed optimizer); lit3d gathers right after the step.
        sequence_first: Activations are laid out (sequence, batch, hidden), as Megatron's: sequence parallelism's
            gathers and scatters of the sequence then need no copy. lit3d and torchtitan lay them out (batch,
            sequence, hidden), and DTensor copies each gathered or scattered tensor through a buffer.
        recomputed_matmuls: The share of the forward's matmuls that recompute runs again; None: as the run's
            ``activation_checkpointing`` (full: all, lit3d's selective: none). torchtitan's per-op selective
            recompute: every second one, 0.5; it then keeps only the other matmul outputs, and gathers SP's inputs
            again.
        overlap_grad_reduce: The gradients' reduction (ZeRO-0/1/2) starts during the last backward, bucket by bucket
            (PyTorch's DDP and FSDP, Megatron-Core); False: it starts after backward ends (DeepSpeed's and
            Megatron-LM's before 2023).
        fp8_cast_bytes: Bytes moved per element of an FP8 GEMM operand to cast it; None: torchao's eager casts
            (`lit3d.planner.calibration.FP8_CAST_BYTES`). Transformer Engine and XLA fuse the cast into the kernel
            that writes the operand, which then writes one byte more per element: 1.
        saved_activations: What a block's norms and SwiGLU keep for backward: ``eager`` as lit3d's modules under
            autograd (each norm its fp32 input and normalised input, the SwiGLU gate, up, silu(gate) and their
            product); ``fused`` as Transformer Engine's and Megatron's fused kernels: each norm its input and output in
            the compute dtype, the SwiGLU its input (gate and up) and output; ``compiled`` as a compiler's fusion
            (XLA): each norm and the SwiGLU only their input, their outputs recomputed in backward. None: as the
            run's ``compile`` (`kept_for_backward`).
        bf16_grads: Gradients accumulated, held and reduced in bf16 under bf16-mixed (Megatron-Core's default:
            ``grad_reduce_in_fp32`` off); lit3d sums and reduces them in fp32.
        bf16_optimizer: The optimizer's state held in bf16 under bf16-mixed: both of Adam's moments and, where master
            weights are kept, their copy, half the bytes of fp32 state (Apex's ``DistributedFusedAdam`` with
            ``dtype: bf16``, as NeMo 24.07-24.09's Nemotron-4 340B config sets it); lit3d keeps them in fp32.
        fp32_reduce: Gradients reduced in fp32 under bf16-true, then held in bf16: FSDP2's
            ``MixedPrecisionPolicy(reduce_dtype=torch.float32)`` on a model built in bf16 (NeMo AutoModel's); lit3d's
            bf16-true reduces them in bf16.
        offloaded_layers: Blocks per pipeline rank whose saved activations are copied to host memory in forward and
            back before their backward, beside the compute (Megatron-Core's ``cpu_offloading_num_layers``); the
            device keeps one such block's in transit. lit3d keeps every block's on the device (0).
        loss_bytes: Bytes per element of the log-probabilities the loss keeps for backward: lit3d computes its loss
            in fp32 (4); a loss on bf16 logits keeps them in bf16 (2: NeMo AutoModel's ``fp32_upcast: false``, and
            Transformer Engine's cross entropy, which writes its gradient into the logits).
        loss_grad_bytes: Bytes per element of the logits that the loss's backward makes beside what it kept, before
            any parameter's gradient; None: PyTorch's cross entropy (lit3d's, torchtitan's), whose backward makes the
            gradient of the log-probabilities and then that of the logits beside the log-probabilities it kept:
            twice ``loss_bytes``. Megatron-Core's vocabulary-parallel cross entropy writes its gradient into the fp32
            softmax it kept and casts it to bf16 for the head (2); Transformer Engine's writes it into the bf16 logits
            (0).
        fp8_saved_inputs: Under ``float8``, each FP8 linear keeps its input's FP8 cast for backward (Transformer
            Engine): the norms' and the SwiGLU's outputs in one byte each instead of the compute dtype's, and a cast
            of the attention output beside it. lit3d's FP8 (torchao) keeps the inputs as they came (False). Counted
            for blocks without recompute or adapters; others as without it.
    """

    attention: str = "flash2"
    fused: bool | None = None
    tp_overlap: float = 0.0
    overlap_param_gather: bool = False
    sequence_first: bool = False
    recomputed_matmuls: float | None = None
    overlap_grad_reduce: bool = True
    fp8_cast_bytes: float | None = None
    saved_activations: str | None = None
    bf16_grads: bool = False
    bf16_optimizer: bool = False
    fp32_reduce: bool = False
    offloaded_layers: int = 0
    loss_bytes: int = 4
    loss_grad_bytes: int | None = None
    fp8_saved_inputs: bool = False

    def kept_for_backward(self, compile: bool | str, moe: bool) -> str:
        """`saved_activations`, or where it is None what lit3d's blocks keep under the run's ``compile``: a dense
        block that Inductor compiles keeps what ``fused`` counts, anything else what ``eager`` counts (the MoE
        feed-forward, and other backends: ``aot_eager`` keeps what autograd keeps). NOTE: measured, not derived: on
        an H200 (2026-11-29, `benchmarks/gpu_check.py`) the compiled llama3.2-1b at micro-batch 16 peaked at 108.27
        GB, ``fused`` plans 107.68 (``compiled``, the min-cut's least, 94.79; ``eager`` 129.15, as its eager run's
        129.75 measured)."""
        if self.saved_activations is not None:
            return self.saved_activations
        return "fused" if compile in (True, "inductor") and not moe else "eager"

    @property
    def loss_gradient_bytes(self) -> int:
        """`loss_grad_bytes`, or PyTorch's cross entropy's where it is None."""
        return 2 * self.loss_bytes if self.loss_grad_bytes is None else self.loss_grad_bytes


@dataclass
class Training:
    """The training loop's numbers; the run's settings (ZeRO, schedule, recompute, ...) are its `Parallelism`."""

    seq_len: int = 2048
    micro_batch_size: int = 1
    global_batch_size: int = 512  # sequences per optimizer step
    # Micro-steps per optimizer step that each run a whole pipeline schedule (pp > 1): the schedule then has
    # global_batch_size / (dp x micro_batch_size x accumulate_grad_batches) micro-batches. Without a pipeline
    # every micro-batch is a micro-step of its own already.
    accumulate_grad_batches: int = 1
    precision: str = "bf16-mixed"  # Lightning's
    software: Software = Software()  # how its kernels are written (the clock's `lit3d.planner.clock`)
    headroom: float = 0.1  # of GPU memory kept free for the allocator, CUDA context and buffers
    lora: LoRA | None = None  # low-rank adapters train, every other weight frozen (`lit3d.LoRA`)
    # Packed documents kept apart (document masking) of about this many tokens: the model FLOPs (and MFU) count only
    # the attention within each document. (The step is priced as whole-sequence attention: the masked kernel lit3d
    # runs computes the masked blocks too.)
    document_length: int | None = None
    optimizer: str = "adamw"  # or "muon": one momentum for the hidden matrices (`lit3d.GPT`'s ``optimizer``)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")

    def schedules_per_step(self, pp: int) -> int:
        """Pipeline schedules run per optimizer step (gradient accumulation repeats the whole schedule)."""
        return self.accumulate_grad_batches if pp > 1 else 1


@dataclass
class Plan:
    layout: dict[str, int]
    # Bytes on the most loaded rank: what it holds of each kind at most, and its peak (``total``: the most of backward's
    # start, its end and the optimizer step, not their sum, `buffers.peak_memory`), with the buffers of that moment.
    memory_per_gpu: dict[str, int]
    communication_per_step: dict[str, dict[str, float]]  # per axis: bytes (per GPU) and seconds
    pipeline_bubble: float
    step_time_s: float
    mfu: float
    fits: bool
    num_microbatches: int
    tokens_per_s_per_gpu: float = 0.0
    # Seconds of the step by kind, summing to it: compute (matmuls and attention, recompute included), memory_bound
    # (elementwise work, the loss, kernel overheads), exposed_communication per axis, bubble, optimizer, overhead.
    time_breakdown: dict[str, Any] = field(default_factory=dict)
    memory_by_stage: list[dict[str, int]] = field(default_factory=list)
    flops_per_step: float = 0.0  # model FLOPs of one optimizer step, all GPUs (recompute not counted)
    # NOTE: the model's own count (`GPTConfig.num_params`), as transformers counts the folder: the embedding and head
    # rows padded to `pad_vocab_multiple` are held (memory, `params_per_rank`) but are not the model's parameters.
    params_total: int = 0
    params_per_rank: int = 0  # parameters (elements) the most loaded rank holds, ZeRO-3 shards included
    params_active: int = 0  # parameters one token uses (MoE: k of the routed experts; a dense model: all)
    activation_bytes_per_layer: int = 0  # what one block keeps for backward, per micro-batch on one rank
    pipeline_schedule: str | None = None  # with a pipeline: the schedule this estimate runs
    # With a pipeline: every schedule the planner weighed for this layout (`lit3d.planner.pipeline`), each with its
    # micro-batches, bubble, step time and activations.
    schedule_candidates: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def rejoin_bytes(self) -> int:
        """What a replica group that rejoins (``replica_groups``) loads per rank from a live group's, once: the most
        loaded rank's weights and optimizer state (`lit3d.strategies.runtime.peer_state`)."""
        return self.memory_per_gpu["params"] + self.memory_per_gpu["optimizer"]


# The settings the planner assumes where none are given: the strategy's defaults, with sequence parallelism on (with
# tensor parallelism it only saves memory and traffic).
PLANNING_DEFAULTS = Parallelism(sequence_parallel=True)


def held_precision(training: Training, settings: Parallelism, layout: Layout) -> Precision:
    """Bytes per element that a lit3d run of ``training`` with ``settings`` on ``layout`` holds and sends:
    ``training.precision``'s row of `PRECISIONS`, or `MASTER_WEIGHTS` where the strategy keeps master weights, with
    the reduce dtype asked for (``settings.mixed_precision_reduce``)."""
    precision = PRECISIONS[training.precision]
    if ZeroPolicy.of(settings, layout).keeps_master_weights(training.precision):
        precision = MASTER_WEIGHTS
    if is_bf16_mixed(training.precision) and settings.mixed_precision_reduce == "bfloat16":
        precision = replace(precision, reduced=2)
    if is_bf16_mixed(training.precision) and training.software.bf16_grads:  # (another stack's: `Software`)
        precision = replace(precision, grads=2, reduced=2)
    if is_bf16_mixed(training.precision) and training.software.bf16_optimizer:
        precision = replace(precision, optimizer=precision.optimizer // 2)
    if training.precision == "bf16-true" and training.software.fp32_reduce:
        precision = replace(precision, reduced=4)
    return precision


@dataclass(frozen=True)
class Case:
    """One planned run, passed whole down the planner's estimate: the model, the cluster, the layout (which owns the
    sizes), the training loop's numbers and the run's other settings; what it holds and sends (`held_precision`)
    and what its ZeRO stage means (`lit3d.parallel.zero.ZeroPolicy`) are read from it."""

    config: Any  # `lit3d.models.config.GPTConfig`
    cluster: Cluster
    layout: Layout
    training: Training
    settings: Parallelism = PLANNING_DEFAULTS

    @cached_property  # (the memory, the traffic and the clock each read it)
    def precision(self) -> Precision:
        return held_precision(self.training, self.settings, self.layout)

    @cached_property
    def zero(self) -> ZeroPolicy:
        return ZeroPolicy.of(self.settings, self.layout)

    def scheduled(self, settings: Parallelism, accumulate: int) -> Case:
        """This case run with ``settings`` (these but for the pipeline schedule: not checked) and ``accumulate``
        schedules per step, keeping what it holds and sends, its ZeRO and its key where worked out: none depends on
        the schedule or the micro-batches (each is kept only if the settings it reads are the same)."""
        training = replace(self.training, accumulate_grad_batches=accumulate)
        case = Case(self.config, self.cluster, self.layout, training, settings)
        if _read(settings) == _read(self.settings):
            case.__dict__.update({k: v for k, v in self.__dict__.items() if k in ("precision", "zero", "key")})
        return case

    @property
    def chunks(self) -> tuple[int, str]:
        """The model chunks each pipeline rank runs and their placement (`lit3d.parallel.schedules.SCHEDULES`): what
        decides which blocks each rank holds."""
        pp, settings = self.layout.pp, self.settings
        return settings.chunks_per_rank if pp > 1 else 1, SCHEDULES[settings.pipeline_schedule].placement

    @cached_property
    def key(self) -> tuple:
        """The model's `config_key` with its adapters and its stages' blocks, built once: what it holds, sends and
        steps is cached by it."""
        return config_key(self.config, self.training.lora, self.settings.pipeline_stage_layers, self.training.optimizer)


def _read(settings: Parallelism) -> tuple:
    """What a `Case`'s precision, ZeRO and key read of its settings."""
    return (
        settings.zero_stage,
        settings.accumulate_unsharded,
        settings.mixed_precision_reduce,
        settings.pipeline_stage_layers,
    )
