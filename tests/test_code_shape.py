"""The shape of the code, checked: short files and functions, a strategy without mixins, no method replaced at run
time, and pure packages that do not load Lightning."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "lit3d").rglob("*.py"), *(ROOT / "strategies").rglob("*.py")])
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def test_there_are_sources_to_check():
    assert len(SOURCES) > 50 and any(path.name == "parallel3d.py" for path in SOURCES)


def test_no_source_file_is_longer_than_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines (split them by job): {long}"


def test_no_function_is_longer_than_60_lines():
    long = {}
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_strategy_is_no_mix_of_lit3d_classes():
    from lit3d.strategies import Parallel3DStrategy

    ours = [cls.__qualname__ for cls in Parallel3DStrategy.__mro__[1:] if cls.__module__.startswith("lit3d")]
    assert ours == [], f"lit3d classes in Parallel3DStrategy's MRO: {ours}"


# An assignment to a module's `forward`, `loss` or `inputs_and_targets`, or to a Lightning object's methods (the
# precision plugin's clipping, say), or a method swapped with setattr.
REPLACED = re.compile(
    r"\.(forward|loss|inputs_and_targets|clip_grad_by_norm|clip_gradients|training_step|backward)\s*=[^=]"
    r"|setattr\([^,]+,\s*\"(forward|loss|inputs_and_targets|\w+_one_chunk)\""
    r"|\.__class__\s*="
)


def test_no_method_is_replaced_at_run_time():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in SOURCES
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if REPLACED.search(line)
    ]
    assert not found, "\n".join(found)


def module_state(source: str) -> list[str]:
    """What ``source`` keeps per process: a ``global`` statement, or a module-level name bound to an empty list,
    dict or set (a table filled while the program runs)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Global):
            found.append(f"{node.lineno}: global {', '.join(node.names)}")
    for node in ast.parse(source).body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        shown = isinstance(value, ast.List | ast.Dict | ast.Set)
        empty = shown and not getattr(value, "elts", getattr(value, "keys", 1))
        called = isinstance(value, ast.Call) and getattr(value.func, "id", "") in ("list", "dict", "set")
        made = called and not value.args and not value.keywords
        if empty or made:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


# Memos: values keyed by everything they are computed from, which no run can make stale (and each says so in a NOTE)
MEMOS = {
    "lit3d/models/rotary.py": ["_ROTARY_TABLES"],
    "lit3d/models/attention.py": ["_BIASES"],
    "lit3d/planner/tensors.py": ["_INTERNED"],
}


def test_no_module_keeps_state_of_the_run():
    """Per-batch and per-run values are passed (`lit3d.models.batch_context`) or held by an object, never by a module:
    a module's state outlives the run and is shared by every model and trainer of the process."""
    found = {}
    for path in SOURCES:
        name = str(path.relative_to(ROOT))
        state = [s for s in module_state(path.read_text()) if s.split(": ")[1].split(":")[0] not in MEMOS.get(name, [])]
        if state:
            found[name] = state
    assert not found, found


def test_module_state_is_found():  # the check above can fail
    assert module_state("_depth = 0\ndef f():\n    global _depth\n") == ["3: global _depth"]
    assert module_state("_WEIGHT: list[float] = []\nCACHE = dict()\nTABLE = {'a': 1}\n") == [
        "1: _WEIGHT: list[float] = []",
        "2: CACHE = dict()",
    ]


def test_the_pattern_finds_a_replaced_method():  # the check above can fail
    assert REPLACED.search("module.model.forward = self.forward")
    assert REPLACED.search("self.precision_plugin.clip_grad_by_norm = self._clip")
    assert REPLACED.search("mesh.__class__ = Named")
    assert REPLACED.search('setattr(stage, "forward_one_chunk", timed)')
    assert not REPLACED.search("if module.loss == other:")


@pytest.mark.parametrize("statement", ["import lit3d.parallel, lit3d.planner", "import lit3d.parallel.settings"])
def test_the_pure_packages_do_not_load_lightning(statement):
    code = f"{statement}, sys; assert 'lightning' not in sys.modules, [m for m in sys.modules if 'lightning' in m]"
    run = subprocess.run([sys.executable, "-c", f"import sys; {code}"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
