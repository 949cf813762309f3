import os
import re
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from layouts import (
    CHAT,
    CP_LAYOUTS,
    DEEP,
    DOCUMENTS,
    HALF,
    LAYOUTS,
    LONG,
    LONG_MOE,
    LORA,
    LORA_DEEP,
    LORA_LAYOUTS,
    LORA_LONG,
    LORA_MOE,
    MOE_LAYOUTS,
    PACKED_LAYOUTS,
    SMALL_GPT,
    SMALL_MOE,
    STEPS,
    VAL_BATCHES,
    merge,
)
from turns import LOCK_VARIABLE, end_turns, held, share_turns, turn

from lit3d import GPTConfig

os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def pytest_configure(config):
    # NOTE: one thread per process. The suite's two workers, and the ranks and commands they start, share 2 cores;
    # a second OpenMP thread per process spins against the other worker (measured: a tiny `lit3d fit` of 20 steps
    # beside a busy core took 15 s of wall clock and 16 s of CPU with torch's default of 2 threads, 10 s and 9 s with
    # one; alone, both took 11 s). Commands a test starts inherit the variable (Lightning then leaves it be).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    config.names_turns = share_turns()  # (`turns`: tests that start several ranks take turns on the machine)
    config.suite_began, config.busy_began = time.time(), cores_busy()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        yield_to_ranks()


# NOTE: ranks run in lock step, so a rank that waits for a core stalls its peers as well: a 2-rank job that shares the 2
# cores with the other worker's single-process test ran far slower than alone (the 99 jobs of 2 ranks held the machine
# 236 s in a suite run, 168 s alone, and took 339 s of CPU against 262 s). So each worker's own work (its tests, and the
# processes it starts itself) runs at a lower priority than the ranks and commands forked from its fork server: it takes
# the cores the ranks leave while they wait for each other, and only a quarter of one they want (nice 5).
WORKER_NICENESS = 5


def cores_busy() -> float | None:
    """Seconds the machine's cores have spent working since it started (None where /proc/stat is not)."""
    try:
        user, nice, system, _, _, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def yield_to_ranks() -> None:
    """Start this worker's fork server (`forked`) at the normal priority, then lower the worker's own."""
    import multiprocessing.forkserver

    import forked  # noqa: F401 (names what the fork server imports)

    multiprocessing.forkserver.ensure_running()
    os.nice(WORKER_NICENESS)


def pytest_terminal_summary(terminalreporter, config):
    """How long the runs of several ranks held the machine, one after another (`turns`): the floor under the suite's
    time, and the tests and spawns (by their jobs' folder) that held it longest."""
    if not getattr(config, "names_turns", False) or not Path(os.environ[LOCK_VARIABLE]).exists():
        return
    turns_held = held()
    if not turns_held:
        return
    waited, total = sum(w for _, w, _, _ in turns_held), sum(s for _, _, s, _ in turns_held)
    terminalreporter.section("runs of several ranks, one at a time (tests/turns.py)")
    terminalreporter.write_line(f"{len(turns_held)} held the machine for {total:.0f} s in all (waited {waited:.0f} s)")
    first, last = min(e - s for _, _, s, e in turns_held), max(e for *_, e in turns_held)
    free = time.time() - config.suite_began - total
    terminalreporter.write_line(f"none held it for {free:.0f} s: {first - config.suite_began:.0f} s before the first, "
                                f"{time.time() - last:.0f} s after the last")  # fmt: skip
    if config.busy_began is not None:  # every process's work (/proc/stat: in a container, the host's)
        busy, cores, elapsed = cores_busy() - config.busy_began, os.cpu_count() or 1, time.time() - config.suite_began
        share = f"{busy / cores / elapsed:.0%}"
        terminalreporter.write_line(f"the {cores} cores were busy {busy:.0f} core-s of {elapsed:.0f} s ({share}): "
                                    f"{busy / cores:.0f} s of work for each")  # fmt: skip
    by_group = {}  # a test, or the folder of a spawn's jobs
    for holder, _, seconds, _ in turns_held:
        group = holder.split("/")[0] if "::" not in holder else holder
        by_group[group] = by_group.get(group, 0.0) + seconds
    for group, seconds in sorted(by_group.items(), key=lambda item: -item[1])[:20]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {group}")


def pytest_unconfigure(config):
    if getattr(config, "names_turns", False):
        end_turns()


@pytest.fixture(autouse=True)
def take_turns(request):
    """A test marked `ranks` holds the machine's turn (`turns`) while it runs."""
    with turn(request.node.nodeid) if request.node.get_closest_marker("ranks") else nullcontext():
        yield


def pytest_collection_modifyitems(config, items):
    # NOTE: `layout_runs` spawns every layout once for the session (about 10 minutes on 2 cores beside the other
    # xdist worker, taking turns with it); the first test that asks for it pays for that, so tests that use it get a
    # longer limit than the suite's 300 s.
    for item in items:
        if "layout_runs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(1800))
    order = file_order({Path(item.path) for item in items})
    items.sort(key=lambda item: order[Path(item.path)])  # (stable: each file's tests stay together, in their order)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; its CPU counterpart runs instead")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# A file that starts ranks (a spawn, a command of several devices, a test that takes the machine's turn).
STARTS_RANKS = re.compile(r"run_jobs|turn\(|mark\.ranks|forked\.start|devices=[2-9]")


def file_order(paths: set[Path]) -> dict[Path, int]:
    """The files that read `layout_runs` first (one xdist worker spawns it, taking turns on the machine for about 5
    minutes, its ranks leaving part of the 2 cores idle as they wait for each other), then those of one process (the
    other worker runs them meanwhile, with no turn to wait for), then the rest (`pytest_xdist_make_scheduler` keeps this
    order)."""
    texts = {path: path.read_text() for path in paths}
    return {path: 0 if "layout_runs" in text else 2 if STARTS_RANKS.search(text) else 1 for path, text in texts.items()}


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist (``-n 2``): each file's tests on one worker, so its module-scoped fixtures are made once, and every
    file that reads `layout_runs` on the same worker, so its spawn runs once.

    NOTE: not ``--dist loadgroup`` with ``xdist_group`` marks: under pytest 9.2 (which reads a node's id from ``_id``)
    xdist's rewrite of ``_nodeid`` groups nothing. `_split_scope` is the method xdist's own `LoadFileScheduling`
    overrides."""
    from xdist.scheduler import LoadScopeScheduling

    tests = Path(__file__).parent
    shared = {f"{tests.name}/{p.name}" for p in tests.glob("test_*.py") if "layout_runs" in p.read_text()}

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "layout_runs" if path in shared else path

    config.option.loadscopereorder = False  # (xdist would order the files by their number of tests: `file_order`'s)
    return FileScheduling(config, log)


# A run in this process (Lightning under Parallel3DStrategy, in a test or a shared fixture) sets these and keeps its
# process group, whose store holds MASTER_PORT: a command a test starts must not inherit them. Once a process group
# exists, Lightning does not read them again, so every test starts without them.
LAUNCH_ENVIRONMENT = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


@pytest.fixture(autouse=True)
def no_launch_environment():
    for key in LAUNCH_ENVIRONMENT:
        os.environ.pop(key, None)
    yield


@pytest.fixture
def small_config() -> GPTConfig:
    """Small enough for fast CPU tests, with grouped-query heads."""
    return GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=256, max_seq_len=64)


@pytest.fixture
def text_folder(tmp_path: Path) -> Path:
    """A folder of a few small text documents."""
    import random

    words = random.Random(0).choices(["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"], k=6 * 400)
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    for i in range(6):
        target = folder / ("sub" if i % 2 else "") / f"doc{i}.txt"
        target.write_text(" ".join(words[i * 400 : (i + 1) * 400]) + "\n")
    return folder


# ---------------------------------------------------------------- multi-rank runs (`layouts`), shared by the tests


@pytest.fixture(scope="session")
def packed_data(tmp_path_factory) -> dict[str, dict]:
    """The ``data`` arguments of the chat and the document-masking runs."""
    import json

    from helpers import chat_file, chat_tokenizer

    folder = tmp_path_factory.mktemp("packed")
    chat = {"data_path": str(chat_file(folder / "chat.jsonl", 120, max_words=200)), "val_fraction": 0.2,
            "tokenizer": str(chat_tokenizer(folder / "tokenizer")), "seq_len": 256, "global_batch_size": 8}  # fmt: skip
    rng = __import__("random").Random(1)
    lines = [json.dumps({"text": " ".join(rng.choices(["ab", "cde", "f", "gh"], k=rng.randint(2, 40)))})
             for _ in range(400)]  # fmt: skip
    (folder / "short.jsonl").write_text("\n".join(lines))
    return {"chat": chat, "documents": {"data_path": str(folder / "short.jsonl")}}


def with_data(job: dict, packed: dict[str, dict]) -> dict:
    """``job`` with the files of `packed_data` if it trains on chat data or on packed short documents."""
    if job.get("data_class") == "chat":
        return merge(job, {"data": packed["chat"]})
    if job.get("data", {}).get("document_masking"):
        return merge(job, {"data": packed["documents"]})
    return job


@pytest.fixture(scope="session")
def reference_chat_run(base_job, packed_data, tmp_path_factory) -> dict:
    """The single-process run on chat data, which its layouts are compared with."""
    return reference(base_job, with_data(CHAT, packed_data), tmp_path_factory.mktemp("reference_chat"))


@pytest.fixture(scope="session")
def reference_documents_run(base_job, packed_data, tmp_path_factory) -> dict:
    """The single-process run on short documents packed with document masking."""
    return reference(base_job, with_data(DOCUMENTS, packed_data), tmp_path_factory.mktemp("reference_documents"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    import random

    words = random.Random(0).choices(
        ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "def", "("], k=6 * 600
    )
    folder = tmp_path_factory.mktemp("corpus")
    for i in range(6):
        (folder / f"doc{i}.txt").write_text(" ".join(words[i * 600 : (i + 1) * 600]))
    return folder


@pytest.fixture(scope="session")
def base_job(corpus) -> dict:
    return dict(
        model=dict(config=SMALL_GPT, learning_rate=1e-2, warmup_steps=2),
        data=dict(data_path=str(corpus), seq_len=16, global_batch_size=8, val_fraction=0.1),
        trainer=dict(max_steps=STEPS, gradient_clip_val=0.5, limit_val_batches=VAL_BATCHES, val_check_interval=STEPS),
    )


def reference(base_job: dict, overrides: dict, folder: Path) -> dict:
    """The single-process run of ``base_job`` with ``overrides``, which layouts of the same model are compared with."""
    from spawned import run_job

    return run_job(merge(base_job, overrides), folder)


@pytest.fixture(scope="session")
def reference_run(base_job, tmp_path_factory) -> dict:
    """The single-process run every layout is compared with."""
    return reference(base_job, {"test_after_fit": True}, tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="session")
def reference_deep_run(base_job, tmp_path_factory) -> dict:
    """The single-process run of the 4-block model (`DEEP`), which the layouts of 4 stages are compared with."""
    return reference(base_job, DEEP, tmp_path_factory.mktemp("reference_deep"))


@pytest.fixture(scope="session")
def reference_bf16_run(base_job, tmp_path_factory) -> dict:
    """The single-process bf16-mixed run the bf16-mixed layouts are compared with."""
    return reference(base_job, {"trainer": {"precision": "bf16-mixed"}}, tmp_path_factory.mktemp("reference_bf16"))


@pytest.fixture(scope="session")
def reference_moe_run(base_job, tmp_path_factory) -> dict:
    """The single-process run of the MoE model, which the MoE layouts are compared with."""
    return reference(base_job, {"model": {"config": SMALL_MOE}}, tmp_path_factory.mktemp("reference_moe"))


@pytest.fixture(scope="session")
def reference_long_run(base_job, tmp_path_factory) -> dict:
    """The single-process run of 256-token sequences, which the context-parallel layouts are compared with."""
    return reference(base_job, LONG, tmp_path_factory.mktemp("reference_long"))


@pytest.fixture(scope="session")
def reference_long_moe_run(base_job, tmp_path_factory) -> dict:
    """The single-process run of the MoE model on 256-token sequences."""
    return reference(base_job, LONG_MOE, tmp_path_factory.mktemp("reference_long_moe"))


@pytest.fixture(scope="session")
def reference_lora_run(base_job, tmp_path_factory) -> dict:
    """The single-process run with LoRA adapters, which the LoRA layouts are compared with."""
    return reference(base_job, LORA, tmp_path_factory.mktemp("reference_lora"))


@pytest.fixture(scope="session")
def reference_lora_long_run(base_job, tmp_path_factory) -> dict:
    """The single-process run with adapters on 256-token sequences, which context parallelism is compared with."""
    return reference(base_job, LORA_LONG, tmp_path_factory.mktemp("reference_lora_long"))


@pytest.fixture(scope="session")
def reference_lora_deep_run(base_job, tmp_path_factory) -> dict:
    """The single-process run of the 4-block model with adapters, for LoRA's layouts of 4 stages."""
    return reference(base_job, LORA_DEEP, tmp_path_factory.mktemp("reference_lora_deep"))


@pytest.fixture(scope="session")
def reference_lora_moe_run(base_job, tmp_path_factory) -> dict:
    """The single-process run of the MoE model with adapters on its attention."""
    return reference(base_job, LORA_MOE, tmp_path_factory.mktemp("reference_lora_moe"))


@pytest.fixture(scope="session")
def family_references(base_job, packed_data, tmp_path_factory) -> dict[str, dict]:
    """The single-process run of each family's tiny model (`FAMILY_CONFIGS`), which its layouts are compared with (and
    of the 4-block DeepSeek-V3 its V follows: `family_layouts.reference_jobs`)."""
    from family_layouts import reference_jobs

    folder = tmp_path_factory.mktemp("reference_families")
    jobs = {name: with_data(job, packed_data) for name, job in reference_jobs().items()}
    return {name: reference(base_job, job, folder / name) for name, job in jobs.items()}


@pytest.fixture(scope="session")
def muon_references(base_job, tmp_path_factory) -> dict[str, dict]:
    """The single-process Muon runs (``dense``, ``deep``, ``moe``, ``clip``) its layouts are compared with
    (`muon_layouts`)."""
    from muon_layouts import MUON, MUON_CLIP, MUON_DEEP, MUON_MOE

    folder = tmp_path_factory.mktemp("reference_muon")
    jobs = (("dense", MUON), ("deep", MUON_DEEP), ("moe", MUON_MOE), ("clip", MUON_CLIP))
    return {name: reference(base_job, job, folder / name) for name, job in jobs}


@pytest.fixture(scope="session")
def float8_references(base_job, layout_runs, tmp_path_factory) -> dict[str, dict]:
    """On one spawned rank (FP8 is a `Parallel3DStrategy` setting, whose process group must not outlive the run in
    this process): the single-process FP8 runs (``tensorwise``, ``rowwise``) the FP8 layouts are compared with, and
    (``resumed_in_bf16``) the TP2 FP8 run's checkpoint of step `FP8_SAVED` resumed in bf16."""
    from float8_layouts import FP8_JOB, FP8_SAVED, ROWWISE, TENSORWISE
    from spawned import run_jobs

    saved = layout_runs["fp8_tp2_sequence_parallel"]["job_dir"] + f"/ckpts/step={FP8_SAVED}.ckpt"
    jobs = {"tensorwise": {**FP8_JOB, "strategy": TENSORWISE}, "rowwise": {**FP8_JOB, "strategy": ROWWISE},
            "resumed_in_bf16": {**FP8_JOB, "strategy": {}, "ckpt_path": saved}}  # fmt: skip
    jobs = {name: merge(base_job, job) for name, job in jobs.items()}
    return run_jobs(1, jobs, tmp_path_factory.mktemp("reference_float8"))


@pytest.fixture(scope="session")
def reference_uneven_run(base_job, tmp_path_factory) -> dict:
    """The single-process run of the 6-block model the uneven pipeline stages are compared with."""
    from uneven_layouts import UNEVEN_GPT

    return reference(base_job, {"model": {"config": UNEVEN_GPT}}, tmp_path_factory.mktemp("reference_uneven"))


@pytest.fixture(scope="session")
def cpu_profile(tmp_path_factory) -> str:
    """A profile as `lit3d calibrate` writes it (the planner's CPU core, two processes), for runs that price their
    step on it (``plan_profile``: ``"CPU_PROFILE"`` in a layout's strategy)."""
    import json
    from dataclasses import asdict

    from lit3d.planner.hardware import cpu_share

    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    path.write_text(json.dumps({"gpu": asdict(cpu_share(2, cores=2, memory_gb=8.0)), "collective_latency_us": 50.0}))
    return str(path)


def with_profile(job: dict, profile: str) -> dict:
    strategy = job.get("strategy", {})
    if strategy.get("plan_profile") != "CPU_PROFILE":
        return job
    return {**job, "strategy": {**strategy, "plan_profile": profile}}


@pytest.fixture(scope="session")
def layout_runs(base_job, packed_data, cpu_profile, tmp_path_factory) -> dict[str, dict]:
    """Every layout of `LAYOUTS`, `MOE_LAYOUTS`, `CP_LAYOUTS`, `LORA_LAYOUTS`, `PACKED_LAYOUTS`, `FAMILY_LAYOUTS`,
    `FLOAT8_LAYOUTS`, `UNEVEN_LAYOUTS`, `SHARE_LAYOUTS`, `HSDP_LAYOUTS`, `MUON_LAYOUTS` and `MUON_RESUMED`, one
    spawn per world size."""
    from family_layouts import FAMILY_LAYOUTS
    from float8_layouts import FLOAT8_LAYOUTS
    from hsdp_layouts import HSDP_LAYOUTS
    from muon_layouts import MUON_LAYOUTS, MUON_RESUMED
    from spawned import run_jobs
    from uneven_layouts import SHARE_LAYOUTS, UNEVEN_LAYOUTS

    layouts = {**LAYOUTS, **MOE_LAYOUTS, **CP_LAYOUTS, **LORA_LAYOUTS, **PACKED_LAYOUTS, **FAMILY_LAYOUTS,
               **FLOAT8_LAYOUTS, **UNEVEN_LAYOUTS, **SHARE_LAYOUTS, **HSDP_LAYOUTS, **MUON_LAYOUTS,
               **MUON_RESUMED}  # fmt: skip
    results = {}
    for world in sorted({w for w, _ in layouts.values()}):
        jobs = {
            name: merge(base_job, with_profile(with_data(job, packed_data), cpu_profile))
            for name, (w, job) in layouts.items()
            if w == world
        }
        results.update(run_jobs(world, jobs, tmp_path_factory.mktemp(f"world{world}")))
    return results


def dp2_then_resumed_on_one_process(job: dict, out: Path) -> dict[str, dict]:
    """``job`` at DP2 checkpointed after step `HALF` (``"dp2"``), and resumed from that checkpoint on one process
    (``"resume_single"``): for runs that must continue exactly on another data-parallel size."""
    from spawned import run_jobs

    saved = str(out / "dp2" / "ckpts" / f"step={HALF}.ckpt")
    results = run_jobs(2, {"dp2": merge(job, {"strategy": {}, "checkpoint_at": HALF})}, out)
    results.update(run_jobs(1, {"resume_single": merge(job, {"strategy": {}, "ckpt_path": saved})}, out))
    return results


@pytest.fixture
def lighthouse():
    """torchft's lighthouse in this process (the replica groups' tests): its address."""
    from torchft.coordination import LighthouseServer

    # NOTE: a group that is not asking for the next quorum when the others ask (the tests slow a group that runs
    # alone; a loaded machine may) is waited for up to join_timeout_ms, then left out; a dead group is dropped after
    # heartbeat_timeout_ms
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=5000, quorum_tick_ms=20,
                              heartbeat_timeout_ms=2000)  # fmt: skip
    yield server.address()
    server.shutdown()
