"""Where lit3d 0.3's modules went in 0.4 (folders by job), so that what names the old places still works: a user's
``import lit3d.gpt``, a YAML ``class_path: lit3d.gpt.GPT``, and a checkpoint that pickled a ``lit3d.lora_settings.LoRA``
(Lightning's own strategies save hyper-parameters so).

NOTE: Python has no alias for a module path; this finder answers an old name with the module at the new place (the
same module object, so classes stay identical and ``isinstance`` holds). `lit3d.data` kept its name as a package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

MOVED = {
    "lit3d.strategies.checkpoint": "lit3d.strategies.checkpoint_folder",
    "lit3d.strategies.checkpointing": "lit3d.strategies.checkpoints",
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
    "lit3d.hf": "lit3d.hf.folders",
    "lit3d.hf_config": "lit3d.hf.config",
    "lit3d.hf_experts": "lit3d.hf.experts",
    "lit3d.hf_export": "lit3d.hf.export",
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


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name of `MOVED` and loads it as its new module."""

    def __init__(self) -> None:
        self.specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        self.specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.specs.pop(module.__spec__.name)  # its own again (importlib gave it the old name's)


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
