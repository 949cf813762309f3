"""A rank that dies ends the whole job, quickly and with a non-zero exit: nothing waits forever."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def start_long_run(tmp_path):
    """4 ranks (DP2 x TP2) training for far longer than the test; returns the process and its output lines."""
    command = [
        sys.executable,
        str(ROOT / "cli.py"),
        "fit",
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        "--trainer.devices=4",
        "--trainer.strategy=Parallel3DStrategy",
        "--trainer.strategy.tensor_parallel_size=2",
        "--trainer.max_steps=100000",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        "--data.init_args.seq_len=32",
        "--data.init_args.global_batch_size=4",
    ]
    proc = subprocess.Popen(
        command,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.time() + 180
    while not any("lit3d layout" in line for line in lines):  # every rank has joined the process group
        assert proc.poll() is None and time.time() < deadline, "".join(lines)[-3000:]
        time.sleep(0.5)
    time.sleep(5)  # well into training
    return proc, lines


@pytest.mark.parametrize("victim", ["rank 2 (a child process)", "rank 0 (the launching process)"])
def test_killing_one_of_4_ranks_ends_the_job(tmp_path, victim):
    proc, lines = start_long_run(tmp_path)
    ranks = children(proc.pid)
    assert len(ranks) == 3
    try:
        target = ranks[1] if victim.startswith("rank 2") else proc.pid
        os.kill(target, signal.SIGKILL)
        killed_at = time.time()
        deadline = killed_at + 120
        while (alive(proc.pid) or any(alive(r) for r in ranks)) and time.time() < deadline:
            time.sleep(0.5)
        print(f"{victim} killed: every rank gone after {time.time() - killed_at:.1f} s")
        survivors = [r for r in [proc.pid, *ranks] if alive(r)]
        assert not survivors, f"still running 2 minutes after {victim} was killed: {survivors}"
        assert proc.wait(timeout=5) != 0
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if alive(proc.pid) else None
        for r in ranks:
            if alive(r):
                os.kill(r, signal.SIGKILL)
