"""The checks of a run that need more than its settings: the layout against the launched ranks and the model, the
module against lit3d's protocol. `Parallel3DStrategy.check_configuration` runs them in the launching process before
any rank starts (`lit3d.strategies.runtime.launchers`), and again in each rank. (The settings' own rules are
`lit3d.parallel.Parallelism.check`, run when the strategy is built.)"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit3d.data.batches import GlobalBatchData
from lit3d.errors import ConfigurationError  # noqa: F401 (its 0.4.0 home: `from lit3d.strategies.checks import ...`)
from lit3d.models.config import GPTConfig, check_model_fits_data
from lit3d.parallel.context import check_context_parallel
from lit3d.parallel.layout import Layout, check_model_fits_layout, check_model_fits_pipeline
from lit3d.parallel.precision import check_float8
from lit3d.parallel.settings import Parallelism
from lit3d.parallel.shares import check_shares_fit
from lit3d.parallel.stages import check_stage_layers
from lit3d.strategies.pipelining.step import check_pipeline_protocol
from lit3d.strategies.split.context_parallel import check_module_for_context_parallel
from lit3d.strategies.split.float8 import CPU_MATMUL, emulates, small_gemms_warning
from lit3d.strategies.split.recompute import check_recompute_composes
from lit3d.strategies.torch_compat import rowwise_float8_on_cpu


def check_run(parallelism: Parallelism, layout: Layout, module: Any, trainer: Any, datamodule: Any) -> int:
    """Refuse a model the layout cannot split, or a module it cannot run, naming the values; return the pipeline's
    micro-batches per schedule, chosen from the data's batch when known (else from the settings alone)."""
    config = getattr(module, "config", None)
    config = config if isinstance(config, GPTConfig) else None  # another module's `config` is its own business
    chunks, schedule = parallelism.chunks_per_rank, parallelism.pipeline_schedule
    if config is not None:
        check_model_fits_layout(config, layout)
        check_model_fits_pipeline(config, layout.pp, chunks, schedule)
        check_stage_layers(parallelism.pipeline_stage_layers, config.n_layer, layout.pp * chunks)
    check_recompute_composes(parallelism.activation_checkpointing, parallelism.zero_stage, layout)
    _check_float8(parallelism, layout, module, trainer, datamodule)
    _check_qk_clip(parallelism, layout, getattr(getattr(module, "muon", None), "qk_clip", None))
    seq_len = getattr(datamodule, "seq_len", None)
    check_context_parallel(layout.cp, seq_len, layout.tp, parallelism.sequence_parallel)
    predicting = trainer is not None and trainer.state.fn == TrainerFn.PREDICTING
    check_module_for_context_parallel(module, layout.cp, predicting)
    if config is not None and datamodule is not None and not predicting:  # (prediction feeds prompts, not blocks)
        check_model_fits_data(config, datamodule, module)  # the tokenizer: "auto" settles on the model's here
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and hasattr(datamodule, "check_sizes"):
            datamodule.check_sizes("fit", trainer.accumulate_grad_batches, validates=False)  # (the CLI: both)
    if layout.pp > 1 and hasattr(module, "tensor_parallel_plan"):  # one the strategy splits (`model` comes later)
        check_pipeline_protocol(module, layout.pp)
    batch = getattr(datamodule, "global_batch_size", None) if layout.pp > 1 else None
    accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
    microbatches = parallelism.microbatches(batch, layout.data_replicas, accumulate)
    _check_shares(parallelism, layout, datamodule, accumulate * (microbatches if layout.pp > 1 else 1))
    return microbatches


def _check_float8(parallelism: Parallelism, layout: Layout, module: Any, trainer: Any, datamodule: Any) -> None:
    """FP8 (`check_float8`) on this run: its precision, model and LoRA; each rank's tokens per sequence in multiples of
    16 (the weight gradient's matmul runs over them); a GPU with FP8 tensor cores, or on CPU a known `CPU_MATMUL` (and
    row-wise scales in PyTorch's CPU matmul if it is chosen). Linears too small for FP8 to pay are said on rank 0,
    naming the width (`small_gemms_warning`)."""
    if not parallelism.float8:
        return
    config = getattr(module, "config", None)
    precision = getattr(trainer, "precision", None) if trainer is not None else None
    lora = getattr(module, "lora", None) is not None
    check_float8(parallelism.float8, precision, config if isinstance(config, GPTConfig) else None, layout.tp, lora)
    seq_len = getattr(datamodule, "seq_len", None)
    if seq_len is not None and (seq_len // layout.cp) % 16:
        raise ValueError(
            f"float8={parallelism.float8!r} with seq_len={seq_len} / context_parallel_size={layout.cp}: "
            "FP8 matmuls need each rank's tokens per sequence in multiples of 16"
        )
    accelerator = type(getattr(trainer, "accelerator", None)).__name__
    if accelerator == "CUDAAccelerator":
        import torch

        if torch.cuda.get_device_capability() < (8, 9):
            raise ValueError(
                f"float8={parallelism.float8!r} on {torch.cuda.get_device_name()}: FP8 matmuls need "
                "compute capability 8.9 or later (Ada, Hopper, Blackwell)"
            )
    kernel = accelerator == "CPUAccelerator" and not emulates("cpu")  # (an unknown choice is refused here)
    if kernel and parallelism.float8 == "rowwise" and not rowwise_float8_on_cpu():
        import torch

        raise ValueError(
            f"float8='rowwise' on CPU with PyTorch {torch.__version__} and {CPU_MATMUL}=scaled_mm: its CPU FP8 "
            "matmul takes one scale per tensor (PyTorch 2.13 and later take one per row); use float8='tensorwise', "
            f"or unset {CPU_MATMUL} (torchao's emulation)"
        )
    warning = small_gemms_warning(parallelism.float8, config, layout.tp) if isinstance(config, GPTConfig) else None
    if warning is not None:
        rank_zero_warn(warning)


def _check_qk_clip(parallelism: Parallelism, layout: Layout, threshold: float | None) -> None:
    """QK-clip (`lit3d.models.qk_clip`) needs every logit of a head on one rank and one clip for all replicas."""
    if threshold is None:
        return
    wrong = {
        "context_parallel_size": (
            layout.cp,
            "the ring attention does not record its logits yet",
        ),
        "islands": (parallelism.islands, "each island trains its own weights between outer steps"),
        "sync_every": (parallelism.sync_every, "DiLoCo's outer steps move the weights QK-clip rescaled"),
        "replica_groups": (parallelism.replica_groups or 1, "each group would clip by its own logits"),
    }
    for name, (value, why) in wrong.items():
        if value > 1:
            raise ValueError(f"muon_qk_clip={threshold} with {name}={value}: {why}; not supported yet")


def _check_shares(parallelism: Parallelism, layout: Layout, datamodule: Any, steps: int) -> None:
    """`data_parallel_shares` need lit3d's data (its sampler deals them) and must fit the run."""
    shares = parallelism.data_parallel_shares
    if shares is None:
        return
    if datamodule is not None and not isinstance(datamodule, GlobalBatchData):
        raise ValueError(
            f"data_parallel_shares={list(shares)} needs a lit3d data module (TextDataModule, Chat"
            f"DataModule): its sampler deals the shares; got {type(datamodule).__name__}"
        )
    check_shares_fit(shares, layout.data_replicas, getattr(datamodule, "global_batch_size", None), steps)
