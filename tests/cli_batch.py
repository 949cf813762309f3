"""Run several `lit3d` command lines that are expected to stop early, in one Python process (one start-up).

    python tests/cli_batch.py CASES.json RESULTS.json

writes, per case, the exit code, stdout, stderr (with the error) and whether a process group was ever formed.

A case is ``{"args": [...], "env": {...}}``. Starting a rank is made to fail loudly, so a check that wrongly
lets a bad layout through cannot launch anything from here.
"""

import contextlib
import io
import json
import os
import sys
import traceback
from pathlib import Path


def _no_launch(*args, **kwargs):
    raise RuntimeError("a rank process was started")


def run_case(case: dict) -> dict:
    import torch.distributed as dist
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    from lit3d.cli import main

    _SubprocessScriptLauncher._call_children_scripts = _no_launch
    saved = dict(os.environ)
    os.environ.update(case.get("env", {}))
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            main(case["args"])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
        if not isinstance(exit_.code, int | None):
            stderr.write(str(exit_.code))
    except Exception:
        code = 1
        stderr.write(traceback.format_exc())
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {
        "code": code,
        "stdout": stdout.getvalue(),
        "stderr": stderr.getvalue(),
        "process_group": dist.is_initialized(),
    }


if __name__ == "__main__":
    cases = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps([run_case(case) for case in cases]))
