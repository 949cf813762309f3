"""Start-up: ``lit3d --help`` prints without importing torch, ``lit3d plan`` runs without Lightning or torch (but
``--verify`` builds the real model), and the lazy package still answers every documented name (``from lit3d import
GPT, GPTConfig, Parallel3DStrategy``, ``"3d"``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics")


def modules_after(code: str) -> dict:
    """Runs ``code`` in a fresh interpreter; what it printed last, and the top-level modules it imported."""
    epilogue = "import json, sys; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    run = subprocess.run([sys.executable, "-c", f"{code}\n{epilogue}"], capture_output=True, text=True, timeout=240,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    return {"out": "\n".join(lines[:-1]), "modules": set(json.loads(lines[-1]))}


def test_lit3d_help_imports_neither_torch_nor_lightning():
    ran = modules_after("from lit3d.cli import main\nmain(['--help'])")
    assert "commands:" in ran["out"]
    assert not ran["modules"] & {"torch", *HEAVY}, ran["modules"] & {"torch", *HEAVY}


def test_lit3d_plan_imports_neither_lightning_nor_torch():
    """The planner counts from the config alone (`lit3d.planner.shapes`): ``import torch`` alone takes seconds."""
    ran = modules_after("from lit3d.cli import main\nmain(['plan', '--model', 'tiny', '--gpus_per_node', '2'])")
    assert "layout(s) fit" in ran["out"]
    assert not ran["modules"] & {"torch", *HEAVY}, ran["modules"] & {"torch", *HEAVY}
    fixed = "main(['plan', '--model', 'moe-tiny', '--gpus_per_node', '4', '--tensor_parallel_size', '2', "
    ran = modules_after(f"from lit3d.cli import main\n{fixed}'--pipeline_parallel_size', '2'])")
    assert "torch" not in ran["modules"] and "memory per GPU" in ran["out"], ran["out"]


def test_planning_a_big_model_with_any_strategy_setting_loads_no_lightning():
    """``lit3d plan`` takes every setting of the strategy (`lit3d.parallel.settings.Parallelism`), not the strategy."""
    args = "'--model', 'llama-70b', '--nodes', '8', '--mixed_precision_reduce', 'bfloat16', '--timeout', '0:20:00'"
    ran = modules_after(f"from lit3d.cli import main\nmain(['plan', {args}])")
    assert "layout(s) fit" in ran["out"] and "mixed_precision_reduce=bfloat16" in ran["out"], ran["out"]
    assert not ran["modules"] & {"torch", *HEAVY}, ran["modules"] & {"torch", *HEAVY}
    ran = modules_after("import lit3d.parallel, lit3d.planner, sys\nassert 'lightning' not in sys.modules")
    assert not ran["modules"] & {"torch", *HEAVY}, ran["modules"] & {"torch", *HEAVY}


def test_lit3d_plan_verify_still_parallelises_the_real_model():
    """``--verify`` alone pays for torch (and the strategy's `parallelize_network`, which brings Lightning)."""
    args = "'--model', 'tiny', '--gpus_per_node', '4', '--tensor_parallel_size', '2', '--pipeline_parallel_size', '2'"
    ran = modules_after(f"from lit3d.cli import main\nmain(['plan', {args}, '--verify'])")
    assert "torch" in ran["modules"] and "match" in ran["out"] and "MISMATCH" not in ran["out"], ran["out"]


def test_the_lazy_package_keeps_its_names_and_importing_the_strategies_registers_3d():
    """``import lit3d`` loads nothing heavy; ``import lit3d.strategies`` (or naming the class) registers ``"3d"``."""
    ran = modules_after(
        "import sys, lit3d, lit3d.parallel, lit3d.planner\n"
        "assert 'lightning' not in sys.modules and 'torch' not in sys.modules\n"
        "import lit3d.strategies\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "from lit3d import GPT, GPTConfig, Parallel3DStrategy\n"
        "assert StrategyRegistry['3d']['strategy'] is Parallel3DStrategy is lit3d.strategies.Parallel3DStrategy\n"
        "assert lit3d.GPT is GPT and GPT.__module__ == 'lit3d.models.gpt'\n"
        "assert GPTConfig.__module__ == 'lit3d.models.config'\n"
        "print(sorted(n for n in dir(lit3d) if not n.startswith('_')))"
    )
    assert {"GPT", "GPTConfig", "Parallel3DStrategy"} <= set(eval(ran["out"]))
