"""`GPT`: the LightningModule — what is computed (loss, optimizer, schedule, sampling), never where."""

from __future__ import annotations

import functools
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torchmetrics import MeanMetric

from lit3d.callbacks import Throughput
from lit3d.hf.adapters import adapter_settings, read_adapter
from lit3d.hf.pretrained import read_config, read_meta, read_tensors
from lit3d.models.batch_context import BatchContext
from lit3d.models.config import GPTConfig, check_model_fits_data
from lit3d.models.documents import Documents
from lit3d.models.generation import Sampling, next_token
from lit3d.models.loop import ends_optimizer_step
from lit3d.models.lora import LoRA, freeze_all_but_adapters
from lit3d.models.lora_dropout import Samples, training_samples
from lit3d.models.loss import IGNORED, cross_entropy, trained_share
from lit3d.models.lr_schedule import WarmupCosine, follow_schedule, horizon_warning, optimizer_refusal
from lit3d.models.moe import balance_objective, step_balance
from lit3d.models.mtp import multi_token_loss, step_loss, tokens_ahead
from lit3d.models.optimizer_settings import MuonSettings, choice_refusal
from lit3d.models.optimizers import build_optimizer
from lit3d.models.qk_clip import clip_after_step, clip_refusal, record_logits
from lit3d.models.runner import Runner, WholeNetwork
from lit3d.models.tp_plan import tensor_parallel_plan
from lit3d.models.transformer import Transformer
from lit3d.planner.tensors import adapter_params


class GPT(L.LightningModule):
    """A Llama-style GPT trained on next-token cross-entropy (and with ``num_nextn_predict_layers`` on multi-token
    prediction's: `lit3d.models.mtp`) with AdamW and a warm-up + cosine schedule.

    Args:
        config: A preset name (``tiny``, ``llama3.1-8b``, ``qwen3-8b``, ...: `lit3d.models.config.PRESETS`), a
            model YAML file, or the `GPTConfig` fields.
        learning_rate: Peak learning rate, reached after ``warmup_steps``.
        weight_decay: AdamW weight decay, applied to matrices only (not to norms).
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: Optimizer steps of linear warm-up from 0.
        decay_steps: Step at which the cosine decay reaches its floor; ``None``: the trainer's ``max_steps`` (or its
            estimated steps). A resumed run follows the schedule of its own horizon from the step it resumes at (and
            logs that it was stretched); set ``decay_steps`` to the old horizon to keep the old schedule.
        min_lr_ratio: The floor of the cosine decay as a fraction of ``learning_rate``.
        optimizer_impl: AdamW implementation: ``"foreach"``, ``"fused"`` or ``"auto"`` (PyTorch's choice).
        optimizer: ``"adamw"``, or ``"muon"``: Muon on the blocks' matrices, AdamW on the rest (`lit3d.models.muon`),
            with ``learning_rate`` and ``weight_decay`` for both. ``muon_*`` are Muon's settings (`MuonSettings`:
            momentum, Newton-Schulz steps and dtype, RMS rule, and QK-clip's threshold: `lit3d.models.qk_clip`).
        pretrained: Start from these weights instead of the seed: a local HuggingFace folder (``config.json`` +
            safetensors: Llama, Mistral, Qwen3, Mixtral) or a lit3d checkpoint (a folder of any layout, or a single
            file). Its shapes replace ``config``; every parallel layout shards the weights as it loads them. A LoRA
            run's adapters load as adapters into the same ``lora``, and are merged into their weights otherwise.
        sampling: How ``predict`` (and ``lit3d generate``) continue a prompt.
        lora: Train low-rank adapters (`lit3d.LoRA`) on the linears it targets, every other weight frozen.
        adapter: Start the adapters from a PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``);
            its settings are the run's ``lora``.
    """

    def __init__(
        self,
        config: GPTConfig | str = "tiny",
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 100,
        decay_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        optimizer_impl: str = "auto",
        pretrained: str | None = None,
        sampling: Sampling | None = None,
        lora: LoRA | None = None,
        adapter: str | None = None,
        optimizer: str = "adamw",
        muon_momentum: float = 0.95,
        muon_ns_steps: int = 5,
        muon_ns_dtype: str = "auto",
        muon_rms_rule: str = "match_rms_adamw",
        muon_qk_clip: float | None = None,
    ) -> None:
        super().__init__()
        self.muon = MuonSettings(muon_momentum, muon_ns_steps, muon_ns_dtype, muon_rms_rule, muon_qk_clip)
        refusal = optimizer_refusal(learning_rate, weight_decay, betas, eps, warmup_steps, decay_steps, min_lr_ratio)
        refusal = refusal or choice_refusal(optimizer_impl, optimizer, self.muon, lora is not None or bool(adapter))
        if refusal is not None:
            raise ValueError(refusal)
        self.pretrained = pretrained
        self.config = read_config(pretrained) if pretrained is not None else GPTConfig.load(config)
        if (refusal := clip_refusal(self.config, muon_qk_clip)) is not None:
            raise ValueError(refusal)
        self.sampling = sampling or Sampling()
        self.lora = LoRA(**lora) if isinstance(lora, dict) else lora
        self.adapter = adapter
        if adapter is not None:
            self.lora = adapter_settings(adapter, self.config, self.lora)
        if self.lora is not None:
            self.lora.check_model(self.config)
        self.save_hyperparameters(ignore=["config", "sampling", "lora"])
        self.hparams["config"] = self.config.to_dict()  # plain data, so checkpoints load with weights_only
        self.hparams["lora"] = asdict(self.lora) if self.lora else None
        self.learning_rate, self.weight_decay, self.betas, self.eps = learning_rate, weight_decay, tuple(betas), eps
        self.warmup_steps, self.decay_steps, self.min_lr_ratio = warmup_steps, decay_steps, min_lr_ratio
        self.optimizer_impl, self.optimizer_name = optimizer_impl, optimizer

        # The network is built by `configure_model`, on the device Lightning chooses, or empty (meta) when a
        # model-parallel strategy splits it first and then initialises each rank's shards.
        self.model: Transformer | None = None
        # How this rank runs `model` (`lit3d.models.runner`): the whole network, until a strategy splits it.
        self.runner: Runner = WholeNetwork()

        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self._loss_sum: torch.Tensor | float = 0.0
        self._loss_count = 0
        self._router_loads: list[tuple[torch.nn.Module, torch.Tensor]] = []  # for the biases after backward

    @property
    def tensor_parallel_plan(self) -> dict[str, str]:
        """What the strategy reads to apply tensor parallelism: module name pattern → role
        (`lit3d.models.transformer`), names relative to ``self.model``."""
        return tensor_parallel_plan(self.config)

    @property
    def adapter_params(self) -> int | None:
        """Elements of the LoRA adapters a token uses (None without LoRA): what its FLOPs count (`Throughput`)."""

        return adapter_params(self.config, self.lora) if self.lora is not None else None

    def configure_model(self) -> None:
        """Build the network on the current default device (idempotent; Lightning calls this hook).

        Weights come from `Transformer.reset_parameters`: the seed and each parameter's name alone, or the
        ``pretrained`` weights. Under a meta-device context the network stays empty: the 3D strategy splits it
        first, then initialises each rank's shards. Outside a Trainer, call this yourself (a first forward does it
        too).
        """
        if self.model is not None:
            return
        device = torch.get_default_device()
        with torch.device("meta"):  # shapes only: no memory, and no throw-away default init
            model = Transformer(self.config, self.lora)
        if self.lora is not None:
            freeze_all_but_adapters(model)
        if self.pretrained is not None:
            model.init_source = read_tensors(self.pretrained, self.lora)
        if self.adapter is not None:
            model.init_source = {**(model.init_source or {}), **read_adapter(self.adapter, self.config.n_layer)[1]}
        if self.muon.qk_clip is not None:
            record_logits(model)
        if device.type != "meta":
            model.to_empty(device=device)
            model.tie_weights()
            model.reset_parameters()
        self.model = model

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> GPT:
        """``GPT(pretrained=path, **kwargs)`` with its weights loaded now, on the CPU."""
        model = cls(pretrained=path, **kwargs)
        model.configure_model()
        return model

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, map_location: Any = None, **kwargs: Any) -> GPT:
        """A GPT with a checkpoint's hyper-parameters and weights, on the CPU: a lit3d folder written by any layout
        or a single file, read as data only (`lit3d.hf.pretrained`); ``kwargs`` override hyper-parameters.

        Every weight is the checkpoint's: the ``pretrained`` folder and the ``adapter`` the run started from are not
        read again (its trained adapters are in the checkpoint).

        Unlike Lightning's, it takes no ``hparams_file``, ``strict`` or ``weights_only``: the weights must fit, and
        a checkpoint is always read as data only."""
        saved = read_meta(checkpoint_path)["hyper_parameters"]
        saved = {key: value for key, value in saved.items() if not key.startswith("_")}  # LightningCLI's `_class_path`
        model = cls(**{**saved, "adapter": None, **kwargs, "pretrained": str(checkpoint_path)})
        model.configure_model()
        return model

    def _build_on(self, device: torch.device) -> None:
        if self.model is None:
            with torch.device(device):
                self.configure_model()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids ``[batch, seq]`` → logits ``[batch, seq, vocab_size]``: whole, on every rank, in any layout."""
        self._build_on(tokens.device)
        logits = self.runner.forward(self.model, tokens)
        if hasattr(logits, "full_tensor"):  # vocabulary-sharded DTensor
            logits = logits.full_tensor()
        return logits[..., : self.config.vocab_size]

    # The loss in three parts, run through `self.runner` (`lit3d.models.runner`), so that a strategy can run it in
    # pieces (a pipeline computes `loss_fn` on its last stage, micro-batch by micro-batch): `loss_fn(model(inputs),
    # targets)`.

    @staticmethod
    def inputs_and_targets(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of ``seq_len + 1`` token blocks → the inputs and their next tokens; a target the batch's
        ``loss_mask`` leaves out (a prompt's, or padding) is ``IGNORED``."""
        tokens = batch["input_ids"] if isinstance(batch, dict) else batch
        targets = tokens[:, 1:]
        if isinstance(batch, dict) and "loss_mask" in batch:
            targets = targets.masked_fill(~batch["loss_mask"][:, 1:], IGNORED)
        return tokens[:, :-1], targets

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy (`lit3d.models.transformer.cross_entropy`); with a ``scale``, the sum over the
        trained targets times ``scale / targets.numel()`` (see `loss`)."""
        return cross_entropy(logits, targets, scale)

    def loss(self, batch: Any, samples: Samples | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy of a batch of ``seq_len + 1`` blocks.

        A batch with a ``loss_mask`` (chat data: the answers' tokens) also has a ``loss_scale``: the targets of its
        whole global batch over the trained ones among them (`lit3d.data.sampler.TrainedTokenSampler`). Each piece of
        the batch a rank computes (a micro-batch, a pipeline's, a CP share) returns its trained targets' loss sum times
        that scale over its own target count; the layout averages equal pieces, so the step's loss is the mean over
        every trained token of the global batch, in any layout.

        Packed rows (``positions``, `lit3d.models.documents`) keep their documents apart in attention; a training
        step's ``samples`` key LoRA's dropout masks (`lit3d.models.lora_dropout`); with multi-token prediction the
        tokens ahead (`lit3d.models.mtp`) are made from the whole rows. They reach the network in one
        `lit3d.models.batch_context.BatchContext`, which the runner hands on with the inputs. The loss returned is the
        next token's; the depths' is added to the objective in `training_step`.
        """
        inputs, targets = self.inputs_and_targets(batch)
        self._build_on(inputs.device)
        positions = batch["positions"] if isinstance(batch, dict) and "positions" in batch else None
        scale = batch["loss_scale"][0] if isinstance(batch, dict) and "loss_scale" in batch else None  # (a tensor)
        # NOTE: the tokens ahead in evaluation too, where the depths do not run: a pipeline's stages hand on the same
        # tensors (their embeddings) at every step.
        ahead = None
        if self.config.num_nextn_predict_layers:
            ahead = tokens_ahead(inputs, targets, self.config.num_nextn_predict_layers, positions, scale)
        documents = Documents.of(positions[:, :-1]) if positions is not None else None
        context = BatchContext(documents, samples, ahead=ahead)
        loss_fn = self.loss_fn if scale is None else functools.partial(self.loss_fn, scale=scale)
        return self.runner.loss(self.model, inputs, targets, loss_fn, context)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        samples = None
        if self.lora is not None and self.lora.dropout:  # its masks drawn from each sample's place in the run
            inputs = self.inputs_and_targets(batch)[0]
            samples = training_samples(self.trainer, batch_idx, len(inputs), inputs.device)
        loss = self.loss(batch, samples)
        self._loss_sum = self._loss_sum + loss.detach()
        self._loss_count += 1
        moe = self.model.moe_layers()  # a pipeline stage may hold none, but still joins the balance's reduce
        depths = self.model.mtp_depths()
        if moe and not self.runner.adds_balance_loss:
            # (A pipeline's MoE layers add their term in backward: `BatchContext.objective_weight`.)
            balance = balance_objective(moe, self.config.aux_loss_coef)
            loss = loss + balance * self.runner.balance_weight  # (weighted as the loss is)
        if depths and not self.runner.adds_balance_loss:  # (a pipeline's last stage adds it in backward too)
            loss = loss + self.config.mtp_loss_weight * multi_token_loss(depths) * self.runner.balance_weight
        if ends_optimizer_step(self.trainer):
            self.log_train_loss(self._loss_sum / self._loss_count)
            # The balance is one collective: on the steps Lightning logs, and on every step a sigmoid router's
            # bias follows it; the other steps only drop what their forwards kept. So is the depths' loss.
            logs = self.trainer._logger_connector.should_update_logs
            if self.config.n_expert and (self.config.router == "sigmoid" or logs):
                self._log_balance(moe, self._loss_count)
            if self.config.num_nextn_predict_layers and logs:
                self._log_multi_token(depths, self._loss_count)
            if self.muon.qk_clip is not None:  # (the step's forwards are done; its logits known)
                clip_after_step(self, self._loss_count * self.runner.forwards_per_loss, self.muon.qk_clip)
            for layer in [*moe, *depths]:
                layer.history = []
            self._loss_sum, self._loss_count = 0.0, 0
        return loss

    def _log_balance(self, layers: list[torch.nn.Module], micro_steps: int) -> None:
        """Log ``moe/aux_loss`` (the balance loss summed over layers, the mean of the step's micro-batches and
        replicas) and ``moe/load_imbalance`` (each layer's busiest expert's tokens over the mean, averaged over
        layers), and keep each sigmoid router's load for its bias (`on_before_optimizer_step`). One reduce over all
        ranks: each rank contributes the layers it holds (a pipeline stage holds some), and each layer is divided by
        the ranks that hold it."""
        rows = self.config.n_layer + self.config.num_nextn_predict_layers  # (multi-token prediction's blocks last)
        # The step's forwards (a pipeline's first step also runs a stage on placeholders to learn shapes).
        forwards = micro_steps * self.runner.forwards_per_loss
        stats = step_balance(layers, rows, self.config.n_expert, forwards, self.device)
        stats = self.trainer.strategy.reduce(stats, reduce_op="sum")
        held = stats[:, 1] > 0
        aux, tokens = stats[held, 0] / stats[held, 1], stats[held, 2:]
        imbalance = (tokens.amax(dim=1) / tokens.mean(dim=1).clamp(min=1e-9)).mean()
        self.log("moe/aux_loss", aux.sum(), on_step=True, on_epoch=False, batch_size=1)
        self.log("moe/load_imbalance", imbalance, on_step=True, on_epoch=False, batch_size=1)
        self._router_loads = [(layer.router, stats[layer.index, 2:]) for layer in layers]

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """The sigmoid routers' biases move by the step's loads now, after backward: a block that backward recomputes
        (activation checkpointing) must route its tokens as its forward did. Any multiple of the global tokens per
        expert does: the bias moves by the sign of each expert's load against the mean."""
        for router, load in self._router_loads:
            router.update_bias(load, self.config.router_bias_rate)
        self._router_loads = []

    def _log_multi_token(self, depths: list[torch.nn.Module], micro_steps: int) -> None:
        """Log ``train_mtp_loss``: the depths' loss (`lit3d.models.mtp`), the mean of the step's forwards and of the
        ranks that hold the depths (each computes an equal piece of the batch). One reduce over all ranks."""
        held = torch.zeros(2, device=self.device)  # the loss, and whether this rank holds the depths
        if depths:
            held[0], held[1] = step_loss(depths, micro_steps * self.runner.forwards_per_loss), 1.0
        held = self.trainer.strategy.reduce(held, reduce_op="sum")
        self.log("train_mtp_loss", held[0] / held[1], on_step=True, on_epoch=False, batch_size=1)

    def log_train_loss(self, local_mean: torch.Tensor) -> None:
        """Log the global-batch mean loss (same value on every rank); stop on a non-finite loss."""
        global_mean = self.trainer.strategy.reduce(local_mean, reduce_op="mean")
        # All ranks see the same reduced value, so all stop together instead of leaving others in a collective.
        if not torch.isfinite(global_mean):
            raise FloatingPointError(f"train_loss is {global_mean.item()} at step {self.global_step}; stopping")
        self.log("train_loss", global_mean, on_step=True, on_epoch=False, prog_bar=True, batch_size=1)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_loss.update(self.loss(batch), weight=trained_share(batch))
        self.log("val_loss", self.val_loss, prog_bar=True, batch_size=1)

    def on_validation_epoch_end(self) -> None:
        # compute() already gathered every rank's values; sync_dist only confirms the identical result.
        self.log("val_ppl", torch.exp(self.val_loss.compute()), batch_size=1, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.test_loss.update(self.loss(batch), weight=trained_share(batch))
        self.log("test_loss", self.test_loss, batch_size=1)

    def on_test_epoch_end(self) -> None:
        self.log("test_ppl", torch.exp(self.test_loss.compute()), batch_size=1, sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        """A batch of one prompt (``input_ids`` ``[1, n]``) → its ``prompt`` and ``completion`` token ids."""
        prompt = batch["input_ids"] if isinstance(batch, dict) else batch
        generator = torch.Generator(device=prompt.device).manual_seed(self.sampling.seed + batch_idx)
        tokens = self.generate(prompt, self.sampling, generator)
        return {"prompt": prompt[0], "completion": tokens[0, prompt.shape[1] :]}

    def configure_optimizers(self) -> dict[str, Any]:
        hyper = (self.learning_rate, self.weight_decay, self.betas, self.eps, self.optimizer_impl, self.muon)
        optimizer = build_optimizer(list(self.named_parameters()), self.optimizer_name, *hyper)
        schedule = WarmupCosine(self.warmup_steps, self._decay_steps(), self.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        """A resumed run's schedule follows this run's horizon (``decay_steps`` above), not the checkpoint's."""
        planned = WarmupCosine(self.warmup_steps, self._decay_steps(), self.min_lr_ratio)
        short = horizon_warning(self.warmup_steps, self.decay_steps, self.trainer.max_steps)
        if short is not None:
            rank_zero_warn(short)
        for config in self.trainer.lr_scheduler_configs:
            source = "decay_steps" if self.decay_steps is not None else "max_steps"
            said = follow_schedule(config.scheduler, planned, source)
            if said is not None:
                rank_zero_info(said)

    def _decay_steps(self) -> int:
        if self.decay_steps is not None:
            return self.decay_steps
        if self.trainer.max_steps and self.trainer.max_steps > 0:
            return self.trainer.max_steps
        return max(1, int(self.trainer.estimated_stepping_batches))

    @torch.no_grad()
    def generate(
        self, prompt_tokens: torch.Tensor, sampling: Sampling | None = None, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """The prompt (``[seq]`` or ``[batch, seq]``) and ``sampling.max_new_tokens`` sampled tokens after it (fewer
        when every sequence samples one of ``sampling.stop_ids``, the last token then).

        Under model parallelism every rank must call this with the same prompt and an identically seeded
        ``generator``, so that all ranks feed the same tokens.
        """
        sampling = sampling or self.sampling
        tokens = prompt_tokens[None] if prompt_tokens.ndim == 1 else prompt_tokens
        stop = torch.as_tensor(sampling.stop_ids, dtype=tokens.dtype, device=tokens.device)
        for _ in range(sampling.max_new_tokens):
            logits = self(tokens[:, -self.config.max_seq_len :])[:, -1].float()
            tokens = torch.cat((tokens, next_token(logits, sampling, generator)), dim=1)
            if len(stop) and torch.isin(tokens[:, -1], stop).all():  # (alike on every rank: all sample alike)
                break
        return tokens[0] if prompt_tokens.ndim == 1 else tokens

    def configure_callbacks(self) -> list[L.Callback]:
        """`Throughput` (tokens/s, MFU) in every run, unless the trainer has one already (with its own settings)."""

        return [] if any(isinstance(c, Throughput) for c in self.trainer.callbacks) else [Throughput()]

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and stage != "predict":  # prediction feeds prompts, not seq_len blocks
            check_model_fits_data(self.config, datamodule, self)
