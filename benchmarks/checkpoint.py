"""How long a sharded save holds training up: the synchronous save against the asynchronous one, same run.

    python benchmarks/checkpoint.py                       # a 66M-parameter GPT with its AdamW states, 5 rounds
    python benchmarks/checkpoint.py --n-layer 4 --d-model 512 --rounds 3

One process (a gloo group of one, as a rank of any layout saves its shards): the model's weights and optimizer
states are saved alternately with `lit3d.checkpoint.folder.save` (training waits for the whole write) and
with `lit3d.checkpoint.background.BackgroundSaves` (training waits while the shards are copied to host memory;
the write goes on in a thread, and is waited for before the next round, outside the timing). Each is timed in
interleaved rounds; the medians and their ratio are printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lit3d import GPTConfig  # noqa: E402
from lit3d.checkpoint.background import BackgroundSaves  # noqa: E402
from lit3d.checkpoint.folder import init_optimizer_state, save  # noqa: E402
from lit3d.models.transformer import Transformer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if min(args.n_layer, args.d_model, args.rounds) < 1:
        parser.error("--n-layer, --d-model and --rounds must be at least 1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    config = GPTConfig(n_layer=args.n_layer, n_head=args.d_model // 64, n_kv_head=args.d_model // 64,
                       d_model=args.d_model, d_ff=4 * args.d_model, vocab_size=32000, max_seq_len=256)  # fmt: skip
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters())
    init_optimizer_state(optimizer)
    tensors = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()["state"]]}
    size = sum(t.numel() * t.element_size() for t in _leaves(tensors))
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; {size / 2**20:.0f} MiB saved "
          f"per checkpoint (weights and AdamW states); {args.rounds} rounds", flush=True)  # fmt: skip
    background = BackgroundSaves()
    timings: dict[str, list[float]] = {"synchronous": [], "asynchronous": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = ["synchronous", "asynchronous"] if round_ % 2 == 0 else ["asynchronous", "synchronous"]
            for kind in order:
                path = Path(tmp) / f"{kind}-{round_}.ckpt"
                began = time.perf_counter()
                if kind == "synchronous":
                    save(path, tensors, {"round": round_}, True)
                else:
                    background.start(path, tensors, {"round": round_}, True)
                timings[kind].append(time.perf_counter() - began)
                background.wait()  # outside the timing: the write finishes before the next save
                shutil.rmtree(path)
                print(f"  round {round_}: {kind} save blocked {timings[kind][-1] * 1000:.0f} ms", flush=True)
    sync, asynchronous = (statistics.median(timings[k]) for k in ("synchronous", "asynchronous"))
    print(f"\nsynchronous save blocks training {sync * 1000:.0f} ms; asynchronous {asynchronous * 1000:.0f} ms: "
          f"{asynchronous / sync:.3f} x synchronous (medians, same run)")  # fmt: skip
    dist.destroy_process_group()


def _leaves(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _leaves(value)]
    if isinstance(tree, list | tuple):
        return [leaf for value in tree for leaf in _leaves(value)]
    return []


if __name__ == "__main__":
    main()
