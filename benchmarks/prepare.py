"""`lit3d prepare` on a synthetic corpus: tokenizing throughput, and a training rank's memory against a corpus ten
times smaller (the baseline, measured in the same run).

    python benchmarks/prepare.py                 # ~200 MB and ~20 MB of JSONL, 2 tokenizing processes
    python benchmarks/prepare.py --mb 50 --steps 10

Each corpus is prepared into shards with ``lit3d prepare`` (its MB/s printed), then a tiny GPT trains ``--steps``
steps from each prepared folder in its own process, which reports its resident memory in two parts: its own
(anonymous) memory, which should not grow with the corpus (ratio close to 1), and mapped file pages, which include
the shard pages its reads mapped (page cache, shared and reclaimable). Linux only (``/proc/self/status``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TRAIN = """
import resource, sys
import lightning as L
from lit3d import GPT
from lit3d.data import TextDataModule
L.seed_everything(0)
trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=int(sys.argv[2]), logger=False, enable_progress_bar=False,
                    enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0)
trainer.fit(GPT("tiny"), TextDataModule(sys.argv[1], seq_len=128, global_batch_size=8))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(int(status["RssAnon"].split()[0]) * 1024, int(status["RssFile"].split()[0]) * 1024)
"""


def synthetic_jsonl(path: Path, megabytes: float, seed: int = 0) -> int:
    """Documents of random words, about ``megabytes`` of JSONL; returns the bytes written."""
    rng = np.random.default_rng(seed)
    words = np.array(["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), n)) for n in rng.integers(2, 10, 5000)])
    written = 0
    with open(path, "w") as f:
        while written < megabytes * 1e6:
            text = " ".join(words[rng.integers(0, len(words), 400)])
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)
    return written


def prepare(source: Path, output: Path, num_proc: int) -> float:
    start = time.perf_counter()
    run = subprocess.run([sys.executable, str(ROOT / "cli.py"), "prepare", "--data_path", str(source), "--output",
                          str(output), "--num_proc", str(num_proc)], capture_output=True, text=True)  # fmt: skip
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    print("  " + run.stdout.strip().splitlines()[-1])
    return time.perf_counter() - start


def resident_memory(prepared: Path, steps: int) -> tuple[int, int]:
    """(the process's own memory, file pages it has mapped) at the end of training, in bytes."""
    run = subprocess.run([sys.executable, "-c", TRAIN, str(prepared), str(steps)], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    own, mapped = run.stdout.strip().splitlines()[-1].split()
    return int(own), int(mapped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=200.0, help="size of the large corpus (MB of JSONL)")
    parser.add_argument("--num-proc", type=int, default=2, help="tokenizing processes")
    parser.add_argument("--steps", type=int, default=20, help="training steps from each prepared corpus")
    args = parser.parse_args()
    if args.mb <= 0 or args.num_proc < 1 or args.steps < 1:
        parser.error(f"--mb={args.mb}, --num-proc={args.num_proc} and --steps={args.steps} must be positive")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sizes = {"large": args.mb, "baseline (1/10)": args.mb / 10}
        memory = {}
        for name, megabytes in sizes.items():
            source = tmp / f"{megabytes:g}MB.jsonl"
            written = synthetic_jsonl(source, megabytes)
            print(f"{name}: {written / 1e6:.1f} MB of JSONL")
            seconds = prepare(source, tmp / f"{megabytes:g}MB-prepared", args.num_proc)
            print(f"  lit3d prepare, end to end: {written / 1e6 / seconds:.1f} MB/s with {args.num_proc} process(es)")
            memory[name] = resident_memory(tmp / f"{megabytes:g}MB-prepared", args.steps)
            own, mapped = memory[name]
            print(
                f"  after {args.steps} training steps from the shards: {own / 1e6:.0f} MB of its own (anonymous), "
                f"{mapped / 1e6:.0f} MB of mapped files (libraries, shard pages: page cache)"
            )
        large, small = memory["large"], memory["baseline (1/10)"]
        print(
            f"{args.mb:g} MB corpus / {args.mb / 10:g} MB corpus (baseline): own memory {large[0] / small[0]:.3f}, "
            f"all resident {sum(large) / sum(small):.3f}"
        )


if __name__ == "__main__":
    main()
