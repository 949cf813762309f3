"""lit3d 0.3's names keep working until lit3d `REMOVED_IN` (`lit3d.moved`), each with one DeprecationWarning that names
its new path: the imports 0.3's README and docs showed, a YAML ``class_path`` and a pickle that name a class by its old
module. The 0.3 names that did not move work without a warning.

NOTE: pytest's configuration ignores DeprecationWarning, and a name warns only the first time a process uses it, so the
warnings are counted in a fresh process that imports every name twice."""

import importlib
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from lit3d.moved import MOVED, MOVED_NAMES, MovedModules, removed_in

ROOT = Path(__file__).resolve().parents[1]

# What 0.3's README and docs showed (``from lit3d.hardware import GPUS``, ``lit3d.tp_plan.TENSOR_PARALLEL_PLAN``, the
# README's map of the code, YAML class paths), with the main name of each module the map listed, and where each is now
OLD = {
    "lit3d.config.GPTConfig": "lit3d.models.config.GPTConfig",
    "lit3d.presets.PRESETS": "lit3d.models.presets.PRESETS",
    "lit3d.model.Transformer": "lit3d.models.transformer.Transformer",
    "lit3d.model.MLP": "lit3d.models.mlp.MLP",
    "lit3d.tp_plan.TENSOR_PARALLEL_PLAN": "lit3d.models.tp_plan.TENSOR_PARALLEL_PLAN",
    "lit3d.gpt.GPT": "lit3d.models.gpt.GPT",
    "lit3d.runner.WholeNetwork": "lit3d.models.runner.WholeNetwork",
    "lit3d.moe.dispatch": "lit3d.models.moe.dispatch",
    "lit3d.ring_attention.ring_attention": "lit3d.models.ring_attention.ring_attention",
    "lit3d.documents.Documents": "lit3d.models.documents.Documents",
    "lit3d.lora.LoRA": "lit3d.models.lora.LoRA",
    "lit3d.lora_settings.LoRA": "lit3d.models.lora_settings.LoRA",
    "lit3d.data.default_corpus": "lit3d.data.text.default_corpus",
    "lit3d.data.default_corpus_files": "lit3d.data.text.default_corpus_files",
    "lit3d.data.mixture_weights": "lit3d.data.text.mixture_weights",
    "lit3d.sources.load_documents": "lit3d.data.sources.load_documents",
    "lit3d.prepared.PreparedBlocks": "lit3d.data.prepared.PreparedBlocks",
    "lit3d.mixture.MixtureBlocks": "lit3d.data.mixture.MixtureBlocks",
    "lit3d.streaming.StreamedBlocks": "lit3d.data.streaming.StreamedBlocks",
    "lit3d.sampler.TrainedTokenSampler": "lit3d.data.sampler.TrainedTokenSampler",
    "lit3d.batches.GlobalBatchData": "lit3d.data.batches.GlobalBatchData",
    "lit3d.chat_data.ChatDataModule": "lit3d.data.chat.ChatDataModule",
    "lit3d.chat_template.ChatTemplate": "lit3d.data.chat_template.ChatTemplate",
    **{
        f"lit3d.hf.{name}": f"lit3d.hf.folders.{name}"
        for name in ("NAMES", "hf_name", "hf_family", "config_to_hf", "read_folder", "to_lit3d_names", "write_folder")
    },
    "lit3d.pretrained.read_checkpoint": "lit3d.hf.pretrained.read_checkpoint",
    "lit3d.adapters.merge_adapters": "lit3d.hf.adapters.merge_adapters",
    "lit3d.hardware.GPUS": "lit3d.planner.hardware.GPUS",
    "lit3d.hardware.cpu_share": "lit3d.planner.hardware.cpu_share",
    "lit3d.lightning_cli.Lit3DCLI": "lit3d.cli.lightning_cli.Lit3DCLI",
    "lit3d.commands.export": "lit3d.cli.commands.export",
    "lit3d.plan_command.plan": "lit3d.cli.plan_command.plan",
    "lit3d.strategies.checkpoint.ShardedCheckpointReader": "lit3d.checkpoint.folder.ShardedCheckpointReader",
    "lit3d.strategies.checkpointing.Checkpoints": "lit3d.checkpoint.save_load.Checkpoints",
    "lit3d.strategies.safe_io.SafeFileSystemReader": "lit3d.checkpoint.safe_io.SafeFileSystemReader",
    # 0.4's paths of the strategy's modules, grouped by job after it (removed two minor versions later)
    "lit3d.strategies.optimizers.OptimizerSteps": "lit3d.strategies.optim.steps.OptimizerSteps",
    "lit3d.strategies.pipeline.Pipeline": "lit3d.strategies.pipelining.step.Pipeline",
    "lit3d.strategies.rank_life.RankLife": "lit3d.strategies.runtime.rank_life.RankLife",
    "lit3d.strategies.precision.SplitModelPrecision": "lit3d.strategies.optim.dtypes.SplitModelPrecision",
    "lit3d.strategies.timeline.PipelineTimeline": "lit3d.strategies.pipelining.timeline.PipelineTimeline",
    "lit3d.strategies.watchdog.Watchdog": "lit3d.strategies.runtime.watchdog.Watchdog",
    "lit3d.strategies.preemption.StopOnSignal": "lit3d.strategies.runtime.preemption.StopOnSignal",
    "lit3d.strategies.resume.newest_complete_checkpoint": "lit3d.checkpoint.resume.newest_complete_checkpoint",
    "lit3d.strategies.float8.plain_tensors": "lit3d.checkpoint.plain.plain_tensors",
    "lit3d.strategies.zero1.LocalShardOptimizer": "lit3d.strategies.optim.zero1.LocalShardOptimizer",
}

# What 0.3's README and docs showed that is where it was
KEPT = [
    *(f"lit3d.{name}" for name in ("GPT", "GPTConfig", "LoRA", "Parallel3DStrategy")),
    "lit3d.data.TextDataModule",
    "lit3d.data.ChatDataModule",
    *(f"lit3d.callbacks.{name}" for name in ("Throughput", "CommReport", "SampleText")),
    *(f"lit3d.planner.{name}" for name in ("plan", "Request", "Cluster", "format_report", "plan_fleet", "explore")),
    "lit3d.parallel.settings.Parallelism",
    "lit3d.strategies.Parallel3DStrategy",
    "lit3d.strategies.meshes.ParallelMeshes",
    "lit3d.strategies.parallelize.parallelize_network",
]

USE_EVERY_NAME_TWICE = """
import importlib, json, sys, warnings

old_modules, old, kept = json.loads(sys.argv[1])


def lit3d_warnings(statement):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(statement, {})
    return [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and "lit3d" in str(w.message)]


def attribute(path):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


report = {"modules": lit3d_warnings("".join(f"import {module}\\n" for module in old_modules))}
report["torch"] = "torch" in sys.modules
report["submodules"] = lit3d_warnings("import lit3d.hf.folders, lit3d.data.text\\nfrom lit3d.hf import adapters")
report["names"], report["same"] = {}, {}
for path in [*old, *kept]:
    module, _, name = path.rpartition(".")
    try:
        report["names"][path] = [lit3d_warnings(f"from {module} import {name}") for _ in range(2)]
    except Exception as error:
        report["names"][path] = repr(error)
for path, new in old.items():
    report["same"][path] = isinstance(report["names"][path], str) or attribute(path) is attribute(new)  # str: failed
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    light = [module for module in MOVED if not module.startswith("lit3d.strategies.")]  # that package loads torch
    arguments = json.dumps([light, OLD, KEPT])
    run = subprocess.run(
        [sys.executable, "-c", USE_EVERY_NAME_TWICE, arguments], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_every_0_3_import_the_docs_showed_works_and_warns_once_naming_the_new_path(report):
    wrong = {}
    for old, new in OLD.items():
        used = report["names"][old]  # the warnings of the first use and of the second, or the error
        once = isinstance(used, list) and len(used[0]) == 1 and used[1] == []
        if not (
            once
            and all(
                text in used[0][0]
                for text in (old, f"use {new}", f"removed in version {removed_in(old.rpartition('.')[0])}")
            )
        ):
            wrong[old] = used
    assert wrong == {}


def test_an_old_name_is_the_new_object_itself(report):
    assert [old for old, same in report["same"].items() if not same] == []


def test_the_0_3_names_that_stayed_work_without_a_warning(report):
    assert {path: report["names"][path] for path in KEPT if report["names"][path] != [[], []]} == {}


def test_an_old_module_loads_nothing_and_says_nothing_until_a_name_is_used(report):
    assert report["modules"] == []
    assert not report["torch"]  # `lit3d --help` and `lit3d plan` stay free of torch


def test_the_packages_that_took_old_module_names_import_their_modules_without_a_warning(report):
    assert report["submodules"] == []


def test_a_name_0_3_did_not_have_is_refused_as_before():
    with pytest.raises(ImportError, match="cannot import name 'missing' from 'lit3d.gpt'"):
        from lit3d.gpt import missing  # noqa: F401
    with pytest.raises(AttributeError, match="module 'lit3d.hf' has no attribute 'missing'"):
        importlib.import_module("lit3d.hf").missing  # noqa: B018


def test_a_pickle_that_names_a_class_by_its_old_module_loads_the_class():
    from lit3d.models.lora_settings import LoRA

    old_pickle = b"\x80\x02clit3d.lora_settings\nLoRA\nq\x00."  # GLOBAL 'lit3d.lora_settings LoRA', as 0.3 wrote it
    assert pickle.loads(old_pickle) is LoRA


def test_a_yaml_class_path_of_the_old_layout_builds_the_model():
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningModule

    from lit3d.models.gpt import GPT

    parser = ArgumentParser()
    parser.add_subclass_arguments(LightningModule, "model", required=True)
    config = parser.parse_args(["--model=lit3d.gpt.GPT", "--model.init_args.config=tiny"])
    assert type(parser.instantiate_classes(config).model) is GPT


def test_every_old_name_has_a_home_and_no_module_hides_it():
    assert [new for new in MOVED.values() if importlib.util.find_spec(new) is None] == []
    homes = [new.rpartition(".") for new in MOVED_NAMES.values()]
    assert [f"{m}.{n}" for m, _, n in homes if not hasattr(importlib.import_module(m), n)] == []
    # NOTE: the finder comes after Python's own, so a real module of an old name would answer in its place
    assert [old for old in MOVED if not isinstance(importlib.util.find_spec(old).loader, MovedModules)] == []
