"""lit3d's folders are layers: a module imports only from its own layer and the layers below (at module level, inside
functions and for type checking alike), so a folder can be read, tested and changed knowing only what lies under it,
and no folder loops back through another. `LAYERS` is the order; `tests/test_import_graph.py` reads the imports, and
this file groups them by layer."""

import subprocess
import sys
from pathlib import Path

from test_import_graph import ROOT, graph, imported, modules

# Lowest first. A module belongs to the longest name listed that is it or holds it. A layer of several names holds
# top-level modules of lit3d, never two folders (two folders in one layer could import each other).
LAYERS = (
    # The standard library only: the errors any layer raises, what a command may replace, Lightning's noise filtered
    # (the planner's calibration uses it too), the shipped configs by name, and 0.3's names (`lit3d.moved` finds a
    # module by its name when an old name is used, with importlib: `lit3d.hf` and `lit3d.data` answer old names).
    ("lit3d.errors", "lit3d.outputs", "lit3d.quiet", "lit3d.shipped", "lit3d.moved"),
    ("lit3d.parallel",),  # the pure description of a run (no torch)
    ("lit3d.checkpoint",),  # every read and write of a checkpoint: the strategy saves through it, the layers above read
    ("lit3d.models",),  # the network, its config and presets, LoRA, the runner protocol (not `GPT`: see below)
    ("lit3d.hf",),  # HuggingFace folders and PEFT adapters to and from the model; the weights a model starts from
    ("lit3d.data",),  # the data modules (the tokenizer of a model's pretrained folder: lit3d.hf)
    ("lit3d.planner",),  # `lit3d plan` (no torch): the model's tensors, a HuggingFace config.json for `--model FOLDER`
    ("lit3d.strategies",),  # the strategy: asks the planner (3d_auto, plan/* ratios), checks the data module
    ("lit3d.callbacks", "lit3d.model_summary"),  # Throughput (the planner's GPUs), CommReport (the strategy's bytes)
    # NOTE: `GPT`, the LightningModule, starts from HuggingFace folders and lit3d checkpoints (`GPT(pretrained=...)`),
    # counts its adapters with the planner's tensor table and adds `Throughput` to every run: it sits above all of
    # them, and so above the rest of lit3d/models (which lit3d.hf converts). Its place is a folder of its own above
    # the callbacks; the file keeps its 0.4 path (`lit3d.models.gpt`, the class path of every saved run's config).
    ("lit3d.models.gpt",),
    ("lit3d",),  # what a user imports first (`lit3d.GPT`, ... load on first use)
    ("lit3d.cli",),  # the command line: every layer put together (`lit3d export` puts the weights beside the tokenizer)
)
LEVEL = {name: level for level, names in enumerate(LAYERS) for name in names}


def place(module: str) -> str:
    """The name of `LAYERS` that ``module`` belongs to."""
    return max((name for name in LEVEL if module == name or module.startswith(name + ".")), key=len)


def climbing(edges: dict[str, set[str]]) -> list[str]:
    """Every import of ``edges`` (module → the lit3d modules it imports) into a layer above the importer's."""
    return sorted(
        f"{module} ({place(module)}) imports {target} ({place(target)})"
        for module, targets in edges.items()
        for target in targets
        if LEVEL[place(target)] > LEVEL[place(module)]
    )


def test_every_layer_names_a_module_or_folder_and_every_module_has_a_layer():
    known = modules()
    assert not [name for name in LEVEL if name not in known], "LAYERS names what is not there"
    unplaced = [module for module in known if place(module) == "lit3d" and module != "lit3d"]
    assert not unplaced, f"top-level modules without a layer (name them in LAYERS): {unplaced}"
    folders = [name for names in LAYERS if len(names) > 1 for name in names if known[name].name == "__init__.py"]
    assert not folders, f"folders that share a layer (give each its own): {folders}"


def test_no_module_imports_from_a_layer_above_its_own():
    climbs = "\n".join(climbing(graph()))
    assert not climbs, f"imports that climb the layers (move the code to its layer, or hand it in):\n{climbs}"


def test_a_planted_climbing_import_is_found_even_inside_a_function(tmp_path: Path):
    source = tmp_path / "transformer.py"
    source.write_text("def split():\n    from lit3d.strategies.parallelize import parallelize_network\n")
    planted = imported("lit3d.models.transformer", source, modules())
    assert planted == {"lit3d.strategies.parallelize"}
    assert climbing({"lit3d.models.transformer": planted}) == [
        "lit3d.models.transformer (lit3d.models) imports lit3d.strategies.parallelize (lit3d.strategies)"
    ]
    assert climbing({"lit3d.hf.folders": {"lit3d.models.gpt"}, "lit3d.models.gpt": {"lit3d.hf.folders"}}) == [
        "lit3d.hf.folders (lit3d.hf) imports lit3d.models.gpt (lit3d.models.gpt)"
    ]


def test_importing_gpt_loads_no_distributed_checkpoint():
    """DCP loads when a lit3d checkpoint is read or written, not with the model (`lit3d.hf.pretrained`)."""
    code = (
        "import sys, lit3d; lit3d.GPT\n"
        "loaded = [m for m in sys.modules if m.startswith('torch.distributed.checkpoint')]\n"
        "assert not loaded and 'lit3d.models.gpt' in sys.modules, loaded"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]


def test_no_module_of_the_strategy_shares_a_file_name_with_another_of_lit3d():
    """``zero.py`` beside ``parallel/zero.py``, ``precision.py`` beside ``parallel/precision.py``: a name that repeats
    says the same job lives in two places. The strategy's folders (split/, pipelining/, optim/, runtime/, telemetry/)
    name theirs by what each does in the strategy."""
    stems: dict[str, list[str]] = {}
    for module, path in modules().items():
        if path.name != "__init__.py":
            stems.setdefault(module.rpartition(".")[2], []).append(module)
    repeated = {stem: names for stem, names in stems.items() if len(names) > 1}
    assert {stem: names for stem, names in repeated.items() if any(".strategies." in n for n in names)} == {}
