"""What ``lit3d plan`` reads of a run: a model named by a preset, a model YAML, a HuggingFace folder or its
``config.json`` (`read_model`), or a whole ``lit3d fit`` config (`read_fit_config`): its model, the data's sequence
length and batch, the trainer's devices, nodes, precision and gradient accumulation, and the strategy's settings.

Plain YAML is read, as the LightningCLI would instantiate it, without importing Lightning or torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from lit3d.hf.config import read_config
from lit3d.models.config import PRESETS, GPTConfig
from lit3d.parallel.layout import pipeline_microbatches
from lit3d.parallel.schedules import chunks_per_rank
from lit3d.parallel.settings import Parallelism
from lit3d.planner.request import SEARCHED
from lit3d.shipped import find_config

# The top-level keys of a `lit3d fit` config (LightningCLI's), which a model YAML of `GPTConfig` fields never has.
FIT_KEYS = ("trainer", "model", "data", "seed_everything", "ckpt_path", "optimizer", "lr_scheduler")
# What the strategy classes Lightning names by string run, in the planner's terms (ZeRO-3: FSDP's full sharding).
NAMED_STRATEGIES = {"auto": 0, "ddp": 0, "ddp_spawn": 0, "ddp_fork": 0, "ddp_notebook": 0, "fsdp": 3}
THREE_D = ("3d", "parallel3dstrategy")
FSDP_SHARDING = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0}
# Lightning's short precision names, as `lit3d.planner.PRECISIONS` names them.
PRECISION_NAMES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", "64": "64-true"}
# Settings the plan does not depend on and that the YAML holds as text (``timeout: 0:30:00``).
UNPLANNED = ("timeout",)


def read_model(spec: str | GPTConfig) -> GPTConfig:
    """The model ``spec`` names: a preset, a YAML file of `GPTConfig` fields, or a local HuggingFace folder or its
    ``config.json``. A ``lit3d fit`` config is refused with the flag that plans it."""
    if isinstance(spec, GPTConfig):
        return spec
    if spec in PRESETS:  # NOTE: before the path checks: a preset's name may hold a dot (``llama3.2-1b``)
        return GPTConfig.from_name(spec)
    path = Path(spec)
    if path.is_dir() or path.name == "config.json":
        return read_config(path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        fields_ = yaml.safe_load(path.read_text())
        if isinstance(fields_, dict) and any(key in fields_ for key in FIT_KEYS):
            raise ValueError(f"{spec} is a `lit3d fit` config, not a model's fields: plan its run with --config {spec}")
    elif "/" in spec or path.suffix:
        raise FileNotFoundError(
            f"model={spec!r}: no such file or folder (a preset, a model YAML file, or a "
            "HuggingFace folder or its config.json)"
        )
    return GPTConfig.load(spec)


@dataclass(frozen=True)
class FitConfig:
    """What a ``lit3d fit`` config says of a run, in ``lit3d plan``'s terms (None: the config leaves it to the flags'
    defaults).

    Attributes:
        path: The config as given (a file, or the name of a shipped one).
        model: The model (its ``config``, or its ``pretrained`` folder's).
        numbers: ``lit3d plan``'s arguments it gives: ``nodes``, ``gpus_per_node``, ``gpu`` (``CPU`` for a CPU run),
            ``precision``, ``seq_len``, ``global_batch_size``, ``accumulate_grad_batches``, ``lora_rank``,
            ``lora_targets``.
        settings: The strategy's settings of the run: what the config writes over the strategy's defaults (a DDP or
            FSDP run: its ZeRO stage), every size and setting a search would choose written out.
        written: The settings the config writes for `Parallel3DStrategy` (what a command from it must write again).
        searches: The run chooses its own layout (``3d_auto``).
    """

    path: str
    model: GPTConfig
    numbers: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    written: frozenset[str] = frozenset()
    searches: bool = False


def read_fit_config(spec: str) -> FitConfig:
    """The run of the ``lit3d fit`` config ``spec`` (a file, or the name of a config shipped with lit3d)."""
    path = find_config(spec)
    if path is None:
        raise FileNotFoundError(f"config={spec!r}: no such file, nor a config shipped with lit3d")
    sections = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(sections, dict) or not any(key in sections for key in FIT_KEYS):
        raise ValueError(
            f"config={spec!r} is not a `lit3d fit` config (no trainer, model or data section); a model's "
            "fields go to --model"
        )
    trainer = sections.get("trainer") or {}
    model, lora = _model(spec, sections.get("model") or {})
    data = _init_args("data", sections.get("data") or {})
    numbers = {
        "nodes": trainer.get("num_nodes", 1),
        "gpus_per_node": _devices(trainer.get("devices", "auto")),
        "gpu": "CPU" if str(trainer.get("accelerator", "auto")).lower() == "cpu" else None,
        "precision": _precision(trainer.get("precision", "32-true")),
        "seq_len": data.get("seq_len"),
        "global_batch_size": data.get("global_batch_size"),
        "accumulate_grad_batches": trainer.get("accumulate_grad_batches", 1),
        "lora_rank": lora.get("rank"),
        "lora_targets": lora.get("targets"),
    }
    numbers = {name: value for name, value in numbers.items() if value is not None}
    written, searches, settings = _strategy(spec, trainer.get("strategy"))
    return FitConfig(spec, model, numbers, {**strategy_defaults(), **settings}, frozenset(written), searches)


def strategy_defaults() -> dict[str, Any]:
    """The sizes and settings a search chooses, as `Parallel3DStrategy` runs them unless told: its defaults
    (``tensor_parallel_size="auto"``: 1 for a lit3d GPT)."""
    default = Parallelism()
    names = (*SEARCHED, "num_microbatches", "sequence_parallel", "accumulate_unsharded")
    return {name: getattr(default, name) for name in names} | {"tensor_parallel_size": 1}


def run_batches(settings: dict[str, Any], gpus: int, global_batch_size: int, accumulate: int) -> dict[str, int]:
    """How the run of ``settings`` on ``gpus`` splits its global batch, as the strategy and the data module split it:
    the ``micro_batch_size`` of each replica's micro-batches, and with a pipeline ``num_microbatches`` per schedule
    (`pipeline_microbatches`: given, or the strategy's default), ``accumulate`` schedules (or micro-steps) per step."""
    tp, pp, cp = (settings[f"{axis}_parallel_size"] for axis in ("tensor", "pipeline", "context"))
    dp = settings["data_parallel_size"]
    replicas = gpus // ((1 if tp == "auto" else tp) * pp * cp) if dp == "auto" else dp
    schedule, virtual = settings["pipeline_schedule"], settings["virtual_pipeline_size"]
    m = 1
    if pp > 1:
        chunks = chunks_per_rank(schedule, virtual)
        m = pipeline_microbatches(
            settings["num_microbatches"], global_batch_size, replicas, accumulate, pp, chunks, schedule
        )
    if global_batch_size % (replicas * accumulate * m):
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by data_parallel_size={replicas} x "
            f"accumulate_grad_batches={accumulate}"
        )
    return {
        "micro_batch_size": global_batch_size // (replicas * accumulate * m),
        **({"num_microbatches": m} if pp > 1 else {}),
    }


def _model(spec: str, section: dict[str, Any]) -> tuple[GPTConfig, dict[str, Any]]:
    """The model of a config's ``model`` section and its LoRA (``rank``, ``targets``; empty without)."""
    class_path = section.get("class_path", "lit3d.GPT")
    if class_path not in ("lit3d.GPT", "lit3d.models.gpt.GPT", "GPT"):
        raise ValueError(f"config={spec!r}: model.class_path={class_path!r}; lit3d plan plans lit3d.GPT models")
    arguments = _init_args("model", section)
    pretrained = arguments.get("pretrained")
    if pretrained is not None and Path(pretrained, "config.json").is_file():
        model = read_config(pretrained)
    elif pretrained is not None:  # a lit3d checkpoint: its hyperparameters (NOTE: imports torch)
        from lit3d.hf.pretrained import read_config as read_checkpoint_config

        model = read_checkpoint_config(pretrained)
    else:
        model = GPTConfig.load(arguments.get("config", "tiny"))  # (`GPT`'s default)
    return model, arguments.get("lora") or {}


def _init_args(name: str, section: Any) -> dict[str, Any]:
    """A section's arguments: its ``init_args`` under a ``class_path``, or the section itself."""
    if not isinstance(section, dict):
        raise ValueError(f"{name}: {section!r} is not a section of arguments (class_path and init_args)")
    return (section.get("init_args") or {}) if "class_path" in section else section


def _devices(devices: Any) -> int | None:
    """Lightning's ``devices`` as a count (None: ``auto``, decided on the machine)."""
    if isinstance(devices, list):
        return len(devices)
    if isinstance(devices, int) or str(devices).isdigit():
        return int(devices) if int(devices) > 0 else None
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    return None


def _precision(precision: Any) -> str:
    text = str(precision)
    return PRECISION_NAMES.get(text, text)


def _strategy(spec: str, strategy: Any) -> tuple[set[str], bool, dict[str, Any]]:
    """(the settings written for `Parallel3DStrategy`, whether the run chooses its layout, the run's settings) of the
    trainer's ``strategy``: a registered name or a ``class_path`` with ``init_args``."""
    if strategy is None:
        strategy = "auto"
    if isinstance(strategy, str):
        name = strategy.lower()
        if name in THREE_D:
            return set(), False, {}
        if name == "3d_auto":
            return set(), True, {}
        if name in NAMED_STRATEGIES:
            return set(), False, {"zero_stage": NAMED_STRATEGIES[name]}
        raise ValueError(
            f"config={spec!r}: trainer.strategy={strategy!r}; lit3d plan plans Parallel3DStrategy "
            f"(3d), {', '.join(NAMED_STRATEGIES)} runs"
        )
    class_path, arguments = strategy.get("class_path", ""), _init_args("trainer.strategy", strategy)
    kind = class_path.rsplit(".", 1)[-1]
    if kind == "DDPStrategy":
        return set(), False, {"zero_stage": 0}
    if kind == "FSDPStrategy":
        return set(), False, {"zero_stage": FSDP_SHARDING.get(str(arguments.get("sharding_strategy", "FULL_SHARD")), 3)}
    if kind != "Parallel3DStrategy":
        raise ValueError(
            f"config={spec!r}: trainer.strategy.class_path={class_path!r}; lit3d plan plans "
            "Parallel3DStrategy, DDPStrategy and FSDPStrategy runs"
        )
    names = {f.name for f in fields(Parallelism)}
    unknown = sorted(set(arguments) - names - {"auto_layout"})
    if unknown:
        raise ValueError(
            f"config={spec!r}: trainer.strategy.init_args {', '.join(unknown)} are not settings of Parallel3DStrategy"
        )
    settings = {name: value for name, value in arguments.items() if name in names and name not in UNPLANNED}
    return set(arguments) & names, bool(arguments.get("auto_layout")), settings
