"""How long `lit3d plan` takes, as a user runs it (whole processes), and the searches `3d_auto` runs at a fit's start.

    python benchmarks/planner_speed.py                              # 5 runs of each command, taking turns (~1 min)
    python benchmarks/planner_speed.py --runs 9 --compare ../before  # beside another checkout of lit3d, interleaved

Each command runs in a child process (``python -c "from lit3d.cli import main; main()" plan ...``); the commands take
turns, run after run, so that a machine busy with something else slows them alike. Per command the table shows the
median CPU time of the child (user and system: `resource.getrusage` of the children before and after it) and the
median wall time. The child's start (Python, lit3d's imports, the command line's parser: about 0.4 s here) counts in
both, as it does for a user.

``--compare DIR`` runs every command on the checkout in ``DIR`` too (its ``lit3d`` first on ``PYTHONPATH``), in the
same turns, and says whether each printed the same output (and wrote the same page) on both, byte for byte.

The ``3d_auto`` row times `lit3d.strategies.auto_layout.choose` inside its child (CPU time, torch and Lightning
imported before): the fastest plan that fits over every micro-batch size, a search each (llama-70b on 4 x 8 H100s, a
batch of 64 x 4096 tokens in bf16-mixed).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PAGE = "{tmp}/page.html"  # (the page command writes here; a page lit3d wrote is replaced on the next run)
COMMANDS = {
    "llama-70b, 8 x 8 GPUs": "--model llama-70b --nodes 8",
    "mixtral-8x7b, 8 x 8 GPUs": "--model mixtral-8x7b --nodes 8",
    "llama-405b, 128k tokens, 2048 x 8, TP8": "--model llama-405b --seq_len 131072 --nodes 2048 "
    "--global_batch_size 2048 --tensor_parallel_size 8 --top 1",
    "llama-8b, 1 x 8 GPUs": "--model llama-8b --nodes 1",
    "llama-70b page (--html), 8 x 8 GPUs": f"--model llama-70b --nodes 8 --seq_len 4096 --global_batch_size 512 "
    f"--html {PAGE}",
}
AUTO = "3d_auto's choice, llama-70b, 4 x 8 GPUs"
AUTO_CHILD = """
import time
from types import SimpleNamespace
from lit3d.models.config import GPTConfig
from lit3d.parallel.settings import Parallelism
from lit3d.planner import Cluster
from lit3d.strategies.auto_layout import choose

module = SimpleNamespace(config=GPTConfig.from_name("llama-70b"))
trainer = SimpleNamespace(precision="bf16-mixed", accumulate_grad_batches=1)
data = SimpleNamespace(global_batch_size=64, seq_len=4096)
start = time.process_time()
chosen, _, lines = choose(Parallelism(auto_layout=True), module, trainer, data, Cluster(nodes=4, gpus_per_node=8))
print(time.process_time() - start)
print(lines[0])
"""


def run(tree: Path, name: str, tmp: str) -> tuple[float, float, str]:
    """(CPU seconds, wall seconds, output) of one child running ``name`` on the checkout ``tree``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([importable(tree, tmp), os.environ.get("PYTHONPATH", "")])}
    if name == AUTO:
        argv = [sys.executable, "-c", AUTO_CHILD]
    else:
        argv = [sys.executable, "-c", "from lit3d.cli import main; main()", "plan", *COMMANDS[name].split()]
        argv = [arg.format(tmp=tmp) for arg in argv]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    child = subprocess.run(argv, capture_output=True, text=True, cwd=tmp, env=env, check=False)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if child.returncode:
        raise SystemExit(f"{name} on {tree} failed:\n{child.stderr[-3000:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    if name == AUTO:  # the child's own time of `choose`, and what it chose
        seconds, output = child.stdout.split("\n", 1)
        return float(seconds), wall, output
    page = Path(PAGE.format(tmp=tmp))
    return cpu, wall, child.stdout + (page.read_text() if "--html" in COMMANDS[name] else "")


def importable(tree: Path, tmp: str) -> str:
    """A folder from which ``import lit3d`` imports ``tree``'s: the checkout itself, or for another checkout a folder
    of links to its ``lit3d/`` entries with ``strategies/`` and ``configs/`` among them (an editable install of this
    one maps ``lit3d.strategies`` to this checkout's ``strategies/``, which must not be mixed with another's)."""
    if tree == ROOT:
        return str(tree)
    package = Path(tmp) / "compared" / "lit3d"
    if not package.exists():
        package.mkdir(parents=True)
        for entry in (tree / "lit3d").iterdir():
            (package / entry.name).symlink_to(entry)
        for name in ("strategies", "configs"):
            if (tree / name).is_dir() and not (package / name).exists():
                (package / name).symlink_to(tree / name)
    return str(package.parent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each command (default 5)")
    parser.add_argument("--compare", type=Path, help="another checkout of lit3d, run in the same turns")
    parser.add_argument("--only", nargs="*", help="the commands whose names contain one of these words")
    args = parser.parse_args()
    names = [n for n in [*COMMANDS, AUTO] if not args.only or any(word in n for word in args.only)]
    trees = [ROOT] + ([args.compare.resolve()] if args.compare else [])
    times: dict[tuple[Path, str], list[tuple[float, float]]] = {(t, n): [] for t in trees for n in names}
    outputs: dict[tuple[Path, str], set[str]] = {(t, n): set() for t in trees for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for number in range(args.runs):
            for name in names:
                for tree in trees:
                    cpu, wall, output = run(tree, name, tmp)
                    times[tree, name].append((cpu, wall))
                    outputs[tree, name].add(output)
            print(f"run {number + 1} of {args.runs} done", file=sys.stderr)
    print(table(names, trees, times, outputs))


def table(names: list[str], trees: list[Path], times: dict, outputs: dict) -> str:
    """The medians, a row per command (and per checkout compared)."""
    width = max(len(n) for n in names)
    lines = [f"{'command':<{width}}  {'checkout':<10} {'CPU s':>7} {'wall s':>7}  runs"]
    for name in names:
        for tree in trees:
            cpu = statistics.median(c for c, _ in times[tree, name])
            wall = statistics.median(w for _, w in times[tree, name])
            where = "this" if tree == ROOT else "compared"
            same = ""
            if len(trees) > 1 and tree != ROOT:
                alike = outputs[ROOT, name] == outputs[tree, name] and len(outputs[tree, name]) == 1
                same = "  same output" if alike else "  DIFFERENT OUTPUT"
            lines.append(f"{name:<{width}}  {where:<10} {cpu:7.2f} {wall:7.2f}  {len(times[tree, name])}{same}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
