"""The ``lit3d fit`` command that runs a planned layout: the model, the data's sequence length and global batch, the
nodes, devices and precision, the gradient accumulation that makes the planned micro-batches, and the strategy's flags
(`lit3d.planner.report.run_flags`), after the config it was planned from (``lit3d plan --config``)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from lit3d.models.config import GPTConfig
from lit3d.models.presets import PRESETS
from lit3d.planner.inputs import Cluster
from lit3d.planner.search import Candidate


@dataclass(frozen=True)
class Launch:
    """What the command names that a plan does not hold.

    Attributes:
        config: The ``lit3d fit`` config planned (``lit3d plan --config``), which the command starts from.
        model: The flag that names the model (``--model.config=llama-70b``, ``--model.pretrained=FOLDER``); None: the
            config's model, or without a config the planned model's preset name or fields.
        written: The strategy settings the config writes: the command writes each again, with the plan's value.
    """

    config: str | None = None
    model: str | None = None
    written: frozenset[str] = frozenset()


def fit_command(candidate: Candidate, cluster: Cluster, config: GPTConfig, launch: Launch, strategy_flags: str) -> str:
    """``lit3d fit ...`` that runs ``candidate`` on ``cluster``: ``strategy_flags`` (`run_flags`) after the config,
    the model, the cluster, the precision, the data's numbers and the micro-steps per optimizer step."""
    layout, training = candidate.layout, candidate.training
    words = ["lit3d", "fit", *(["--config", launch.config] if launch.config else [])]
    model = launch.model or (None if launch.config else model_flag(config))
    words += [model] if model else []  # (shlex.join quotes a model's fields)
    if cluster.device != "GPU":
        words.append("--trainer.accelerator=cpu")
    words += [
        f"--trainer.num_nodes={cluster.nodes}",
        f"--trainer.devices={cluster.gpus_per_node}",
        f"--trainer.precision={training.precision}",
        f"--data.seq_len={training.seq_len}",
        f"--data.global_batch_size={training.global_batch_size}",
    ]
    # NOTE: without a pipeline each micro-batch is a micro-step; with one, `run_flags` writes the schedules per step.
    micro_steps = training.global_batch_size // (layout.data_replicas * training.micro_batch_size)
    accumulate = micro_steps if layout.pp == 1 else training.accumulate_grad_batches
    if (layout.pp == 1 and accumulate > 1) or (launch.config and accumulate == 1):
        words.append(f"--trainer.accumulate_grad_batches={accumulate}")
    command = shlex.join(words) + " --trainer.strategy=Parallel3DStrategy " + strategy_flags
    flagged = set(re.findall(r"--trainer\.strategy\.(\w+)=", strategy_flags))
    for name in sorted(launch.written - flagged):  # what the config writes and the plan runs otherwise
        command += f" --trainer.strategy.{name}={flag_value(getattr(candidate.parallelism, name))}"
    return command


def model_flag(model: str | GPTConfig) -> str:
    """How ``lit3d fit`` is told the model: ``--model.pretrained=FOLDER`` for a HuggingFace folder (or its
    ``config.json``), ``--model.config=...`` for a preset or a model YAML file, or the fields of a model built in
    Python."""
    if isinstance(model, str):
        path = Path(model)
        if path.is_dir() or path.name == "config.json":
            return f"--model.pretrained={path if path.is_dir() else path.parent}"
        return f"--model.config={model}"
    if model.name in PRESETS and GPTConfig.from_name(model.name) == model:
        return f"--model.config={model.name}"
    fields = {name: value for name, value in model.to_dict().items() if value is not None}
    return f"--model.config={json.dumps(fields, separators=(',', ':'))}"


def flag_value(value: object) -> str:
    """A value as the command line takes it (``true``, ``null``, ``[1,3]``, ``selective``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return "[" + ",".join(map(flag_value, value)) + "]"
    return str(value)
