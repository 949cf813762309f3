"""lit3d's import graph has no cycle, counting imports made inside functions (and for type checking) as well as at
module level: a cycle that a deferred import hides is still a cycle. An import is deferred into a function only to keep
its module light: what it imports loads a library (torch, Lightning, transformers, ...) that the module itself does not,
which keeps ``lit3d --help`` and ``lit3d plan`` free of them."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"lit3d": ROOT / "lit3d", "lit3d.strategies": ROOT / "strategies"}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The lit3d modules `module` imports anywhere in its file (`from lit3d.x import y` counts `lit3d.x.y` when that is
    a module, else `lit3d.x`)."""
    names = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            names.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    return {name for name in names if name in known and name != module}


HEAVY = {
    "torch",
    "lightning",
    "transformers",
    "peft",
    "torchao",
    "datasets",
    "matplotlib",
    "safetensors",
    "tokenizers",
    "jsonargparse",
    "numpy",
    "huggingface_hub",
    # NOTE: a part of torch that takes as long to import as the rest: GPT and the HuggingFace folders go without it,
    # and read a lit3d checkpoint (`lit3d.checkpoint`) only when one is opened.
    "torch.distributed.checkpoint",
}


def module_level(path: Path) -> set[str]:
    """What a module imports when it is imported (``from x import y``: ``x``, and ``x.y`` too; not `TYPE_CHECKING`)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
    return names


def heavy_libraries(module: str, known: dict[str, Path], seen: dict[str, set[str]]) -> set[str]:
    """The libraries of `HEAVY` that importing ``module`` loads (its packages', and through lit3d's modules)."""
    if module not in seen:
        seen[module] = set()
        parents = [".".join(module.split(".")[:n]) for n in range(1, module.count(".") + 1)]
        found = {heavy for name in module_level(known[module]) for heavy in HEAVY if f"{name}.".startswith(f"{heavy}.")}
        for name in [*parents, *module_level(known[module])]:
            found |= heavy_libraries(name, known, seen) if name in known else set()
        seen[module] = found
    return seen[module]


def at_import(known: dict[str, Path]) -> dict[str, set[str]]:
    """What importing each module runs: its module-level imports and their packages' ``__init__``."""
    edges = {}
    for name, path in known.items():
        names = module_level(path)
        names |= {".".join(n.split(".")[:k]) for n in names for k in range(1, n.count(".") + 1)}
        edges[name] = {n for n in names if n in known and n != name and not name.startswith(n + ".")}
    return edges


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_graph_is_read_from_the_code():
    edges = graph()
    assert "lit3d.strategies.parallel3d" in edges and "lit3d.parallel" in edges
    assert "lit3d.parallel" in edges["lit3d.strategies.parallel3d"] or any(
        name.startswith("lit3d.parallel.") for name in edges["lit3d.strategies.parallel3d"]
    )


def test_what_a_module_loads_is_read_from_the_code():
    known, seen = modules(), {}
    assert {"torch", "lightning"} <= heavy_libraries("lit3d.models.gpt", known, seen)
    assert heavy_libraries("lit3d.parallel.settings", known, seen) == set()  # the pure description of a run
    assert "torch.distributed.checkpoint" in heavy_libraries("lit3d.checkpoint.folder", known, seen)
    assert "torch.distributed.checkpoint" not in heavy_libraries("lit3d.models.gpt", known, seen)


def test_a_planted_loop_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_lit3d_imports_no_module_that_imports_it_back():
    # NOTE: a package's __init__ re-exports its modules for users; a module that imports its own package (or a package
    # above it) is left out of the loops, since Python runs the package first either way.
    edges = {
        name: {other for other in targets if not name.startswith(other + ".")} for name, targets in graph().items()
    }
    assert cycles(edges) == []


def test_every_module_can_be_imported_first():
    """At import time (module level, with the packages' ``__init__`` each import runs) no module waits on itself."""
    assert cycles(at_import(modules())) == []


def test_an_import_is_deferred_into_a_function_only_to_keep_its_module_light():
    """...or where, made at module level, it would make a package's ``__init__`` wait on itself (``lit3d.strategies``
    imports the strategy)."""
    known, seen, needless = modules(), {}, []
    running = at_import(known)
    for name, path in known.items():
        light = heavy_libraries(name, known, seen)
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in function.body:
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lit3d"):
                    targets = {f"{node.module}.{a.name}" for a in node.names} & known.keys() or {node.module}
                    if set().union(*(heavy_libraries(t, known, seen) for t in targets if t in known)) - light:
                        continue
                    hoisted = {
                        **running,
                        name: running[name]
                        | {".".join(t.split(".")[:k]) for t in targets for k in range(1, t.count(".") + 2)}
                        & known.keys(),
                    }
                    if not any(name in loop for loop in cycles(hoisted)):
                        needless.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}")
    assert not needless, "imports made inside a function that load nothing their module does not:\n" + "\n".join(
        needless
    )
