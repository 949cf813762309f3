"""lit3d 0.3's names at their 0.4 places, until lit3d `REMOVED_IN` removes them: a user's ``from lit3d.gpt import GPT``
or ``from lit3d.hf import read_folder``, a YAML ``class_path: lit3d.gpt.GPT``, a checkpoint that pickled a
``lit3d.lora_settings.LoRA`` (Lightning saves hyper-parameters so). Each old name warns once, with a DeprecationWarning
that names its new path and the version that removes it.

NOTE: Lightning's ``_graveyard`` way, in one table and one function (`old_name`). An old module (``lit3d.gpt``) is
made an empty module whose ``__getattr__`` (PEP 562) answers each name with the object at its new place, so
importing it loads nothing until a name is used (``lit3d --help`` and ``lit3d plan`` stay free of torch) and the
answer is the object itself: classes stay identical, ``isinstance`` holds, pickles load. A 0.3 module that is a package
now (``lit3d.hf``, ``lit3d.data``) answers its lost names from its own ``__getattr__`` through `old_name`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

REMOVED_IN = "0.6.0"  # 0.3's names: two minor versions after 0.4, which moved them
REMOVED_IN_LATER = "0.7.0"  # 0.4.0's paths that moved after it (`MOVED_SINCE_0_4`): two minor versions after 0.5

# lit3d 0.4.0's modules that moved after it: what saves and loads checkpoints joined `lit3d.checkpoint`, `lit3d export`
# the command line, and the strategy's own modules were grouped by job (split/, pipelining/, optim/, runtime/,
# telemetry/)
MOVED_SINCE_0_4 = {
    "lit3d.strategies.safe_io": "lit3d.checkpoint.safe_io",
    "lit3d.strategies.checkpoint_folder": "lit3d.checkpoint.folder",
    "lit3d.hf.export": "lit3d.cli.export",
    "lit3d.strategies.split_count": "lit3d.strategies.split.count",
    "lit3d.strategies.tensor_parallel": "lit3d.strategies.split.tensor_parallel",
    "lit3d.strategies.context_parallel": "lit3d.strategies.split.context_parallel",
    "lit3d.strategies.recompute": "lit3d.strategies.split.recompute",
    "lit3d.strategies.float8": "lit3d.strategies.split.float8",
    "lit3d.strategies.zero": "lit3d.strategies.split.data_parallel",
    "lit3d.strategies.pipeline": "lit3d.strategies.pipelining.step",
    "lit3d.strategies.stages": "lit3d.strategies.pipelining.chunks",
    "lit3d.strategies.timeline": "lit3d.strategies.pipelining.timeline",
    "lit3d.strategies.optimizers": "lit3d.strategies.optim.steps",
    "lit3d.strategies.zero1": "lit3d.strategies.optim.zero1",
    "lit3d.strategies.zero1_buckets": "lit3d.strategies.optim.zero1_buckets",
    "lit3d.strategies.zero1_params": "lit3d.strategies.optim.zero1_params",
    "lit3d.strategies.precision": "lit3d.strategies.optim.dtypes",
    "lit3d.strategies.islands": "lit3d.strategies.optim.diloco",
    "lit3d.strategies.grad_norm": "lit3d.strategies.optim.grad_norm",
    "lit3d.strategies.launchers": "lit3d.strategies.runtime.launchers",
    "lit3d.strategies.watchdog": "lit3d.strategies.runtime.watchdog",
    "lit3d.strategies.preemption": "lit3d.strategies.runtime.preemption",
    "lit3d.strategies.rank_life": "lit3d.strategies.runtime.rank_life",
    "lit3d.strategies.comm": "lit3d.strategies.telemetry.comm",
    "lit3d.strategies.memory": "lit3d.strategies.telemetry.held_memory",
    "lit3d.strategies.live_memory": "lit3d.strategies.telemetry.live_memory",
    "lit3d.strategies.plan_check": "lit3d.strategies.telemetry.plan_check",
    "lit3d.strategies.checkpoints": "lit3d.checkpoint.save_load",
    "lit3d.strategies.async_checkpoint": "lit3d.checkpoint.background",
    "lit3d.strategies.full_state": "lit3d.checkpoint.whole_file",
    "lit3d.strategies.resume": "lit3d.checkpoint.resume",
}

# Every old module (0.3's, and 0.4.0's above) and its successor, which holds every name of its that `MOVED_NAMES` does
# not place
MOVED = {
    **MOVED_SINCE_0_4,
    "lit3d.strategies.checkpoint": "lit3d.checkpoint.folder",
    "lit3d.strategies.checkpointing": "lit3d.checkpoint.save_load",
    "lit3d.config": "lit3d.models.config",
    "lit3d.presets": "lit3d.models.presets",
    "lit3d.model": "lit3d.models.transformer",
    "lit3d.attention": "lit3d.models.attention",
    "lit3d.rotary": "lit3d.models.rotary",
    "lit3d.moe": "lit3d.models.moe",
    "lit3d.lora": "lit3d.models.lora",
    "lit3d.lora_settings": "lit3d.models.lora_settings",
    "lit3d.lora_dropout": "lit3d.models.lora_dropout",
    "lit3d.tp_plan": "lit3d.models.tp_plan",
    "lit3d.gpt": "lit3d.models.gpt",
    "lit3d.generation": "lit3d.models.generation",
    "lit3d.runner": "lit3d.models.runner",
    "lit3d.ring_attention": "lit3d.models.ring_attention",
    "lit3d.documents": "lit3d.models.documents",
    "lit3d.loop": "lit3d.models.loop",
    "lit3d.schedule": "lit3d.models.lr_schedule",
    "lit3d.sources": "lit3d.data.sources",
    "lit3d.prepared": "lit3d.data.prepared",
    "lit3d.mixture": "lit3d.data.mixture",
    "lit3d.streaming": "lit3d.data.streaming",
    "lit3d.sampler": "lit3d.data.sampler",
    "lit3d.batches": "lit3d.data.batches",
    "lit3d.chat_data": "lit3d.data.chat",
    "lit3d.chat_template": "lit3d.data.chat_template",
    "lit3d.tokenizers": "lit3d.data.tokenizers",
    "lit3d.prompts": "lit3d.data.prompts",
    "lit3d.hf_config": "lit3d.hf.config",
    "lit3d.hf_experts": "lit3d.hf.experts",
    "lit3d.hf_export": "lit3d.cli.export",
    "lit3d.adapters": "lit3d.hf.adapters",
    "lit3d.pretrained": "lit3d.hf.pretrained",
    "lit3d.commands": "lit3d.cli.commands",
    "lit3d.lightning_cli": "lit3d.cli.lightning_cli",
    "lit3d.plan_command": "lit3d.cli.plan_command",
    "lit3d.help_cache": "lit3d.cli.help_cache",
    "lit3d.strategy_names": "lit3d.cli.strategy_names",
    "lit3d.hardware": "lit3d.planner.hardware",
    "lit3d.calibration": "lit3d.planner.calibration",
    "lit3d.calibrate": "lit3d.planner.calibrate",
    "lit3d.checkpoint_errors": "lit3d.errors",
}

# lit3d 0.3's names that did not follow their module: those of the modules that are packages now, and a few more
MOVED_NAMES = {
    **{
        f"lit3d.hf.{name}": f"lit3d.hf.folders.{name}"
        for name in ("NAMES", "hf_name", "hf_family", "config_to_hf", "read_folder", "to_lit3d_names", "write_folder")
    },
    **{f"lit3d.data.{name}": f"lit3d.data.text.{name}" for name in ("default_corpus", "default_corpus_files")},
    "lit3d.data.mixture_weights": "lit3d.data.text.mixture_weights",
    "lit3d.model.MLP": "lit3d.models.mlp.MLP",
    "lit3d.strategies.float8.plain_tensors": "lit3d.checkpoint.plain.plain_tensors",
    "lit3d.strategies.float8.unwrapped": "lit3d.checkpoint.plain.unwrapped",
    "lit3d.strategies.checkpoint.META_FILE": "lit3d.checkpoint.safe_io.META_FILE",
    "lit3d.strategies.checkpoint.check_readable": "lit3d.checkpoint.safe_io.check_readable",
    "lit3d.strategies.checkpoint.check_sizes_are_stored": "lit3d.checkpoint.safe_io.check_sizes_are_stored",
}


def old_name(module: str, name: str) -> Any:
    """``module.name`` as lit3d 0.3 had it, from its new place, with a DeprecationWarning the first time (the answer
    is kept in the old module); an AttributeError for a name 0.3 did not have there."""
    new = MOVED_NAMES.get(f"{module}.{name}")
    if new is None and module in MOVED and not name.startswith("__"):
        new = f"{MOVED[module]}.{name}"
    home, _, attribute = (new or "").rpartition(".")
    if new is None or not hasattr(importlib.import_module(home), attribute):
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    # NOTE: stacklevel 3 passes this function and the ``__getattr__`` that called it: the warning names the line that
    # used the old name, and Python shows it by default when that line is in ``__main__`` (a user's script)
    gone = removed_in(module)
    warnings.warn(f"{module}.{name} is deprecated: use {new} (removed in version {gone})", DeprecationWarning, 3)
    value = getattr(sys.modules[home], attribute)
    setattr(sys.modules[module], name, value)
    return value


def removed_in(module: str) -> str:
    """The version that removes the old module ``module`` (and its names)."""
    return REMOVED_IN_LATER if module in MOVED_SINCE_0_4 else REMOVED_IN


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module of `MOVED` and makes it an empty module that answers its names through `old_name`."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def exec_module(self, module: ModuleType) -> None:
        module.__doc__ = (
            f"lit3d's old {module.__name__}: now {MOVED[module.__name__]}, until version {removed_in(module.__name__)}."
        )
        module.__getattr__ = lambda name: old_name(module.__name__, name)


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
