"""Run a test's command (``python cli.py fit ...``, a benchmark script) forked from a process that has imported torch,
Lightning and lit3d once for the session, instead of in a fresh interpreter that imports them again.

NOTE: written here because neither pytest nor the standard library runs a command line in a pre-imported process.
A fresh interpreter spends about 9 s of a core importing torch, Lightning (and through torchmetrics, transformers)
and HuggingFace datasets before a tiny fit does anything. Measured alone on this 2-core machine: a 20-step
`lit3d fit` took 18.4 s fresh and 5.9 s forked; on two ranks (the second started by the launcher, fresh) 29.5 s and
17.5 s; on two forked ranks (`helpers.FORK`) 21.7 s and 8.1 s.

The child is set up as a fresh process would be: its own argv, folder, environment, ``sys.path`` (the script's folder,
then PYTHONPATH, then the interpreter's own), session, output files, and the exit handlers run at its end. What it
cannot be is a process that imports afresh: a command whose subject is start-up, what importing prints or warns, or
a variable read at import (`read_at_import`) runs fresh: such tests call `subprocess` themselves; a command whose
environment changes such a variable runs fresh here, and one the pre-imported process's own environment differs in is
refused in the child's output.
"""

import atexit
import multiprocessing
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

# The pre-imported process: multiprocessing's fork server, which `spawned` starts ranks from as well.
PRELOAD = ["torch", "lightning.pytorch", "lit3d.models.gpt", "lit3d.strategies", "lit3d.data.text", "lit3d.data.chat",
           "datasets", "torch.distributed.pipelining", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "lit3d.strategies.parallel3d", "lit3d.checkpoint.save_load", "lit3d.cli"]  # fmt: skip
multiprocessing.set_forkserver_preload(PRELOAD)
START_METHOD = "forkserver"


def read_at_import(variable: str) -> bool:
    """Whether a library the pre-imported process has imported may have read ``variable`` then (PYTHONPATH, TMPDIR
    and the suite's own are set in the child; the rest cannot be)."""
    if variable in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "TMPDIR") or variable.startswith("TORCHFT_"):
        return False  # (torchft is not pre-imported)
    prefixes = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "DATASETS", "TOKENIZERS", "TORCH", "PYTORCH", "CUDA",
                "NCCL", "GLOO", "OMP_", "MKL")  # fmt: skip
    return variable.startswith(prefixes)  # (Lightning's PL_* and jsonargparse's are read when used)


def _imported(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if read_at_import(key)}


class Command:
    """A command `start` started: what the tests read of a `subprocess.Popen` (its output is in files, read whole)."""

    def __init__(self, process: multiprocessing.process.BaseProcess | subprocess.Popen, argv: list[str], folder: Path):
        self.process, self.argv, self.folder = process, argv, folder
        weakref.finalize(self, shutil.rmtree, folder, ignore_errors=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        """The exit code, or None while it runs (negative: the signal that ended it)."""
        if isinstance(self.process, subprocess.Popen):
            return self.process.poll()
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        if isinstance(self.process, subprocess.Popen):
            return self.process.wait(timeout)
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.argv, timeout)
        return self.process.exitcode

    def kill(self) -> None:
        if self.poll() is None:
            self.process.kill()

    def stdout(self) -> str:
        """What it printed so far (with its standard error too, if started with ``merge_output``)."""
        return (self.folder / "stdout").read_text(errors="replace")

    def stderr(self) -> str:
        path = self.folder / "stderr"
        return path.read_text(errors="replace") if path.exists() else ""


def start(argv: list[str], *, cwd: Path, env: dict[str, str], new_session: bool = False, merge_output: bool = False):
    """Start ``argv`` (``[sys.executable, SCRIPT | -m MODULE | -c CODE, ...]``) in ``cwd`` with ``env``: forked, or
    fresh if ``env`` changes a variable read at import (`read_at_import`). Its output goes to files (`Command`)."""
    assert argv[0] == sys.executable, argv
    folder = Path(tempfile.mkdtemp(prefix="lit3d-command-"))
    outputs = (folder / "stdout", None if merge_output else folder / "stderr")
    for path in filter(None, outputs):
        path.touch()  # (before the child starts: readable at once, empty)
    if _imported(env) != _imported(dict(os.environ)):
        with open(outputs[0], "w") as out, open(outputs[1] or os.devnull, "w") as err:
            process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err if outputs[1] else out,
                                       start_new_session=new_session)  # fmt: skip
        return Command(process, argv, folder)
    context = multiprocessing.get_context(START_METHOD)
    process = context.Process(target=_child, args=(argv[1:], str(cwd), env, outputs, new_session), daemon=False)
    process.start()
    return Command(process, argv, folder)


def run(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 240):
    """`start` ``argv`` and wait for it: a `subprocess.CompletedProcess` with its output as text."""
    command = start(argv, cwd=cwd, env=env)
    try:
        code = command.wait(timeout)
    finally:
        command.kill()
    return subprocess.CompletedProcess(argv, code, command.stdout(), command.stderr())


def _child(args: list[str], cwd: str, env: dict[str, str], outputs: tuple, new_session: bool) -> None:
    """In the forked process: become ``python ARGS`` run in ``cwd`` with ``env``, then exit as it would."""
    if new_session:
        os.setsid()
    sys.stdout.flush(), sys.stderr.flush()
    out = os.open(outputs[0], os.O_WRONLY)
    os.dup2(out, 1), os.dup2(os.open(outputs[1], os.O_WRONLY) if outputs[1] else out, 2)
    wanted, inherited = _imported(env), _imported(dict(os.environ))
    if wanted != inherited:
        differ = sorted(set(wanted.items()) ^ set(inherited.items()))
        raise SystemExit(f"tests/forked.py: {differ} differ from the pre-imported process's: run the command fresh")
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # (found again from TMPDIR)
    own = [p for p in sys.path if p.startswith((sys.prefix, sys.base_prefix)) or "__editable__" in p]
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    try:
        if args[0] == "-c":
            sys.argv, sys.path[:] = ["-c", *args[2:]], ["", *paths, *own]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif args[0] == "-m":
            sys.argv, sys.path[:] = [args[1], *args[2:]], [cwd, *paths, *own]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(args[0])
            sys.argv, sys.path[:] = [args[0], *args[1:]], [os.path.dirname(script), *paths, *own]
            runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush(), sys.stderr.flush()
