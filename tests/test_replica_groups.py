"""Fault-tolerant replica groups on torchft (`Parallel3DStrategy(replica_groups=...)`, docs/fault-tolerance.md).

Two groups of 2 ranks, each its own process group, meet through a lighthouse started here (torchft's, in-process);
group 1 dies at step 4 (every rank killed, as a failed node ends them), group 0 trains on alone, group 1 is started
again, loads group 0's state in its first quorum and rejoins. Both then hold bitwise equal weights, and the loss each
group logged is the loss of a one-process replay of the same participation (which groups' rows trained each step).
"""

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import forked
import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import FORK, logged
from layouts import SMALL_GPT, merge
from spawned import START_METHOD, free_port, run_job
from test_cli import QUICK, ROOT, fit_losses

from lit3d import GPT, GPTConfig
from lit3d.data.text import TextDataModule
from lit3d.errors import ConfigurationError
from lit3d.models.transformer import Transformer
from lit3d.parallel.settings import Parallelism
from lit3d.strategies.runtime.replica_groups import RECORD_FILE, this_group

os.environ.setdefault("RUST_LOG", "warn")  # (the in-process lighthouse's log of every quorum: read at torchft's import)
pytest.importorskip("torchft", reason="replica groups need torchft (the [test] extra installs it)")

KILLED_AT = 4  # group 1's ranks are killed at the start of this step
AFTER_REJOIN = 3  # steps both groups train together after group 1 is back
# name -> (strategy, model): Muon's states are DTensors under TP (AdamW steps plain local shards), which a rejoin places
LAYOUTS = {
    "tp2": ({"tensor_parallel_size": 2}, {}),
    "dp2_zero3": ({"zero_stage": 3}, {}),
    "muon_tp2": ({"tensor_parallel_size": 2}, {"optimizer": "muon"}),
    "pp2": ({"pipeline_parallel_size": 2}, {}),  # (each rank sends its stage's state)
    "cp2": ({"context_parallel_size": 2}, {}),
}
GROUP_RANKS = 2


class KillAt(L.Callback):
    """SIGKILL to every rank of this group at the start of step ``step``, or (``step=None``) as soon as it has
    joined the others, before its first step: a failure while it is still recovering."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_train_start(self, trainer, pl_module) -> None:
        if self.step is None:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class Together(L.Callback):
    """Ends the fit ``AFTER_REJOIN`` steps after a step every group took part in, once ``final`` exists (a file the
    test writes as it starts the last restarts); a step that some group missed is slowed by a tenth of a second, so
    that restarted groups catch up. Saves this rank's weights at the end."""

    def __init__(self, final: str, weights: str) -> None:
        self.final, self.weights, self.together_at = final, weights, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        groups = trainer.strategy.optimizer_steps.replica_groups
        missing = groups.manager.num_participants() < groups.groups
        if self.together_at is None and not missing and Path(self.final).exists():
            self.together_at = trainer.global_step - 1  # (the step just taken)
        if self.together_at is not None and trainer.global_step >= self.together_at + AFTER_REJOIN:
            trainer.should_stop = True
        elif missing:
            time.sleep(0.1)

    def on_train_end(self, trainer, pl_module) -> None:
        local = {name: getattr(p, "_local_tensor", p).detach() for name, p in pl_module.named_parameters()}
        torch.save(local, self.weights)


@pytest.mark.ranks
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_replica_group_killed_mid_run_rejoins_from_a_live_one_and_both_follow_the_replayed_curve(
    layout, base_job, lighthouse, tmp_path
):
    job = merge(base_job, {
        "strategy": {**LAYOUTS[layout][0], "replica_groups": 2, "timeout": timedelta(seconds=60)},
        "model": {**LAYOUTS[layout][1], "decay_steps": 40},
        "trainer": {"max_steps": 40, "limit_val_batches": 0},
    })  # fmt: skip
    restarted = tmp_path / "group1_restarted"
    first = _start(job, lighthouse, tmp_path, [(0, "g0", -1), (1, "g1_killed", KILLED_AT)], restarted)
    second = kill_then_restart(first, GROUP_RANKS, tmp_path, restarted, lambda: _start(
        job, lighthouse, tmp_path, [(1, "g1", -1)], restarted))  # fmt: skip
    assert [p.exitcode for p in first.processes[:GROUP_RANKS] + second.processes] == [0] * 2 * GROUP_RANKS

    records = {run: _records(tmp_path / run) for run in ("g0", "g1")}
    steps0 = [line for line in records["g0"] if line["event"] == "step"]
    assert [line["step"] for line in steps0] == list(range(len(steps0))) and all(line["committed"] for line in steps0)
    (joined,) = [line for line in records["g1"] if line["event"] == "joined"]
    assert joined["recovered"] and KILLED_AT < joined["step"] < len(steps0) - AFTER_REJOIN + 1, joined
    assert joined["loaded_bytes"] == joined["planned_bytes"] > 0, joined  # (the planner's rejoin: weights, states)
    together = {line["step"] for line in records["g1"] if line["event"] == "step" and line["committed"]}
    assert together == set(range(joined["step"], len(steps0)))
    for rank in range(GROUP_RANKS):  # the same shards, bitwise
        ours, theirs = (torch.load(tmp_path / run / f"weights{rank}.pt") for run in ("g0", "g1"))
        assert all(torch.equal(ours[name], theirs[name]) for name in ours)

    # the groups took part together before the kill (steps 0-3) and after the rejoin; group 0 alone between
    participation = [[0, 1] if s < KILLED_AT or s in together else [0] for s in range(len(steps0))]
    replayed = replay(job, participation, dp=2 if layout == "dp2_zero3" else 1)
    got0 = logged(tmp_path / "g0" / "log" / "version_0", "train_loss")
    got1 = logged(tmp_path / "g1" / "log" / "version_0", "train_loss")
    assert logged_steps(tmp_path / "g1") == sorted(together)  # the restarted group logs at the live group's steps
    assert max(abs(a - b[0]) for a, b in zip(got0, replayed, strict=True)) <= 1e-5
    assert max(abs(a - replayed[s][1]) for a, s in zip(got1, sorted(together), strict=True)) <= 1e-5


@pytest.mark.ranks
def test_three_replica_groups_survive_two_failures_and_one_during_recovery_and_end_together(
    base_job, lighthouse, tmp_path
):
    """Three groups of one rank: group 1 dies at step 3 and group 2 at step 5; group 1 restarted dies again as soon as
    it has joined (its state loaded, its first step not taken); then both come back. Group 0 never stops; the run
    ends with the three bitwise equal, and every group's logged loss is the replay's of the steps each group took
    part in (a step whose average failed moves no weight)."""
    job = merge(base_job, {
        "strategy": {"replica_groups": 3, "timeout": timedelta(seconds=60)},
        "data": {"global_batch_size": 6},
        "model": {"decay_steps": 80},
        "trainer": {"max_steps": 80, "limit_val_batches": 0},
    })  # fmt: skip
    final, deadline = tmp_path / "final", time.time() + 240

    first = _start(job, lighthouse, tmp_path, [(0, "g0", -1), (1, "g1_a", 3), (2, "g2_a", 5)], final, ranks=1)
    wait_until(
        "groups 1 and 2 to die", lambda: [p.exitcode for p in first.processes[1:]] == [-signal.SIGKILL] * 2, deadline
    )
    again = _start(job, lighthouse, tmp_path, [(1, "g1_b", None)], final, ranks=1)
    wait_until("group 1 to die while it recovers", lambda: again.processes[0].exitcode == -signal.SIGKILL, deadline)
    final.touch()
    last = _start(job, lighthouse, tmp_path, [(1, "g1", -1), (2, "g2", -1)], final, ranks=1)
    wait_until(
        "the groups to finish",
        lambda: all(p.exitcode is not None for p in [first.processes[0], *last.processes]),
        deadline,
    )
    assert [p.exitcode for p in [first.processes[0], *last.processes]] == [0, 0, 0]

    records = {run: _records(tmp_path / run) for run in ("g0", "g1_a", "g2_a", "g1_b", "g1", "g2")}
    steps0 = [line for line in records["g0"] if line["event"] == "step"]
    assert [line["step"] for line in steps0] == list(range(len(steps0)))  # group 0 never stopped
    assert min(line["participants"] for line in steps0) < 3 == steps0[-1]["participants"]  # some missing, then all
    joins = {run: [line for line in lines if line["event"] == "joined"] for run, lines in records.items()}
    assert all(join["recovered"] and join["step"] > 0 for run in ("g1_b", "g1", "g2") for join in joins[run]), joins
    assert [line["event"] for line in records["g1_b"]] == ["joined"]  # killed before its first step
    ours = torch.load(tmp_path / "g0" / "weights0.pt")
    for run in ("g1", "g2"):
        theirs = torch.load(tmp_path / run / "weights0.pt")
        assert all(torch.equal(ours[name], theirs[name]) for name in ours)

    took_part = {s: [] for s in range(len(steps0))}
    for lines in records.values():
        for line in lines:
            if line["event"] == "step" and line["committed"]:
                took_part[line["step"]].append(line["group"])
    replayed = replay(job, [sorted(took_part[s]) for s in range(len(steps0))], dp=1, groups=3)
    for run, group in (("g0", 0), ("g1", 1), ("g2", 2)):
        got, steps = logged(tmp_path / run / "log" / "version_0", "train_loss"), logged_steps(tmp_path / run)
        assert max(abs(loss - replayed[step][group]) for loss, step in zip(got, steps, strict=True)) <= 1e-5


WIDER = {**SMALL_GPT, "d_ff": 96}


@pytest.mark.ranks
def test_a_group_that_runs_something_else_is_refused_in_its_first_quorum_naming_both_runs(
    base_job, lighthouse, tmp_path
):
    """Two groups of one rank started together, group 1 with a wider MLP: group 1, which takes group 0's state when
    the run starts, is refused before its first step, naming both runs; group 0 trains on."""
    job = merge(base_job, {
        "strategy": {"replica_groups": 2, "timeout": timedelta(seconds=60)},
        "trainer": {"max_steps": 4, "limit_val_batches": 0},
        "expect_error": True,
        "by_group": {1: {"model": {"config": WIDER}}},
    })  # fmt: skip
    started = _start(job, lighthouse, tmp_path, [(0, "g0", -1), (1, "g1", -1)], tmp_path / "final", ranks=1)
    deadline = time.time() + 120
    while not all(p.exitcode is not None for p in started.processes):
        assert time.time() < deadline, "the groups did not end"
        time.sleep(0.2)
    errors = [json.loads((tmp_path / run / "result0.json").read_text())["error"] for run in ("g0", "g1")]
    run = "dp 1 x tp 1 x pp 1 on 1 rank(s), {:,} parameters, precision 32-true"
    with torch.device("meta"):
        counts = [sum(p.numel() for p in Transformer(GPTConfig(**c)).parameters()) for c in (WIDER, SMALL_GPT)]
    assert errors[0] is None and [line["step"] for line in _records(tmp_path / "g0") if line["event"] == "step"] == [
        0, 1, 2, 3]  # fmt: skip
    assert errors[1].startswith(
        f"ConfigurationError: this replica group runs {run.format(counts[0])}, the live group "
        f"it would load from {run.format(counts[1])}: every replica group runs the same command"
    )
    assert not _records(tmp_path / "g1")  # refused before its join was recorded


def test_a_group_does_not_load_the_state_of_a_live_group_that_runs_something_else():
    from lit3d.strategies.runtime.peer_state import PeerState

    ours = "dp 1 x tp 2 x pp 1 on 2 rank(s), 1,000 parameters, precision 32-true"
    theirs = "dp 2 x tp 1 x pp 1 on 2 rank(s), 1,000 parameters, precision 32-true"
    with pytest.raises(ConfigurationError) as error:
        PeerState(None, ours).load({"run": theirs, "module": {}})
    assert str(error.value).startswith(f"this replica group runs {ours}, the live group it would load from {theirs}")


@pytest.mark.ranks
def test_a_lighthouse_lost_mid_run_ends_every_group_within_the_timeout_naming_it(base_job, tmp_path):
    """Two groups of one rank train; the lighthouse (its own process, as the docs start it) is killed at their third
    step. No quorum can form: each group's next step waits at most the strategy's ``timeout`` (10 s here), then its
    rank raises (recorded), and every process ends; nothing hangs."""
    port = free_port()
    lighthouse = _lighthouse_process(port, join_ms=5000, heartbeat_ms=2000)
    job = merge(base_job, {
        "strategy": {"replica_groups": 2, "timeout": timedelta(seconds=10)},
        "trainer": {"max_steps": 1000, "limit_val_batches": 0},
        "model": {"decay_steps": 1000},
        "expect_error": True,
    })  # fmt: skip
    address, deadline = f"http://localhost:{port}", time.time() + 120
    groups = _start(job, address, tmp_path, [(0, "g0", -1), (1, "g1", -1)], tmp_path / "never", ranks=1)
    while not all(any(line["event"] == "step" and line["step"] >= 2 for line in _records(tmp_path / run))
                  for run in ("g0", "g1")):  # fmt: skip
        assert time.time() < deadline and all(p.exitcode is None for p in groups.processes), "the groups did not train"
        time.sleep(0.2)
    lighthouse.kill()
    lighthouse.wait()
    stopped = time.time()
    while not all(p.exitcode is not None for p in groups.processes):
        assert time.time() < stopped + 60, "a group still runs a minute after the lighthouse stopped"
        time.sleep(0.2)
    errors = [json.loads((tmp_path / run / "result0.json").read_text())["error"] for run in ("g0", "g1")]
    said = f"within the strategy's timeout: the lighthouse at {address} did not answer"  # (at step 3 or 4)
    assert [p.exitcode for p in groups.processes] == [0, 0] and all(said in str(error) for error in errors), errors
    print(f"both groups ended {time.time() - stopped:.1f} s after the lighthouse was killed")  # (-s shows it)


def wait_until(what: str, done, deadline: float, alive: tuple = ()) -> None:
    """Poll ``done()`` until it holds; fail past ``deadline``, or as soon as a process of ``alive`` ends in error."""
    while not done():
        assert time.time() < deadline, f"waited too long for {what}"
        assert all(p.exitcode in (None, 0) for p in alive), f"a live group's process failed while waiting for {what}"
        time.sleep(0.2)


def kill_then_restart(first, ranks: int, out: Path, restarted: Path, restart):
    """Group 1 of ``first`` (its ``ranks`` ranks after group 0's) is killed by its test's injection; once it is dead and
    group 0 has trained a step alone, ``restarted`` is written and ``restart()`` starts group 1 again; returns that
    start once it and group 0 have ended."""
    deadline = time.time() + 240
    dead = lambda: all(p.exitcode == -signal.SIGKILL for p in first.processes[ranks:])
    wait_until("group 1 to die", dead, deadline, alive=tuple(first.processes[:ranks]))
    alone = lambda: any(line["participants"] == 1 for line in _records(out / "g0") if line["event"] == "step")
    wait_until("group 0 to train alone", alone, deadline)  # (slowed while alone: the tests' callbacks)
    restarted.touch()
    second = restart()
    ended = lambda: all(p.exitcode is not None for p in [*second.processes, *first.processes[:ranks]])
    wait_until("the groups to finish", ended, deadline)
    return second


def _lighthouse_process(port: int, join_ms: int, heartbeat_ms: int) -> subprocess.Popen:
    """torchft's lighthouse as the docs start it (``torchft_lighthouse``), in a process of its own, once it listens
    (the groups refuse a lighthouse that is not there yet, before any step)."""
    command = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1", "--join_timeout_ms",
               str(join_ms), "--heartbeat_timeout_ms", str(heartbeat_ms), "--bind", f"[::]:{port}"]  # fmt: skip
    lighthouse = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not _listening(port):
        assert time.time() < deadline and lighthouse.poll() is None, "the lighthouse did not start"
        time.sleep(0.2)
    return lighthouse


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("localhost", port), timeout=1).close()
        return True
    except OSError:
        return False


def _start(job, lighthouse, out, runs, final, ranks=GROUP_RANKS):
    """Start each of ``runs`` (group, its folder, the step its ranks are killed at: -1 never, None on joining) as a
    group of ``ranks`` ranks, with a process group of its own."""
    plan = [
        (group, run, kill, rank, port) for group, run, kill in runs for port in [free_port()] for rank in range(ranks)
    ]
    return mp.start_processes(_rank, args=(plan, job, lighthouse, str(out), str(final), ranks), nprocs=len(plan),
                              start_method=START_METHOD, join=False)  # fmt: skip


def _rank(index, plan, job, lighthouse, out, final, ranks):
    """One rank of a group (``job``'s ``by_group``: a group's own overrides; ``expect_error``: the error it records)."""
    group, run, kill, rank, port = plan[index]
    job = merge(job, job.get("by_group", {}).get(group, {}))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank),
                      NODE_RANK="0", REPLICA_GROUP_ID=str(group), TORCHFT_LIGHTHOUSE=lighthouse)  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    callbacks = [Together(final, str(Path(out) / run / f"weights{rank}.pt"))]
    if kill != -1:
        callbacks.append(KillAt(kill))
    result = run_job({**job, "callbacks": callbacks}, Path(out) / run, ranks)
    if job.get("expect_error"):
        (Path(out) / run / f"result{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def logged_steps(run: Path) -> list[int]:
    with open(run / "log" / "version_0" / "metrics.csv") as file:
        return [int(row["step"]) for row in csv.DictReader(file) if row.get("train_loss")]


def _records(run: Path) -> list[dict]:
    record = run / "log" / "version_0" / RECORD_FILE
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def replay(job: dict, participation: list[list[int]], dp: int, groups: int = 2) -> list[list[float]]:
    """One process, no Lightning: at each step, each group's loss on its rows of the global batch, and the update of
    the mean over the groups in ``participation[step]`` (clipped as the runs clip)."""
    L.seed_everything(job.get("seed", 1234))
    model_kwargs = dict(job["model"])
    model = GPT(GPTConfig(**model_kwargs.pop("config")), **model_kwargs)
    model.configure_model()
    data = TextDataModule(**job["data"])
    data.data_parallel = (1, 0)
    data.setup("fit")
    configured = model.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    losses = []
    for taking_part, batch in zip(participation, data.train_dataloader(), strict=False):
        tokens = batch["input_ids"]
        rows = [[i for i in range(len(tokens)) if i % (groups * dp) // dp == g] for g in range(groups)]
        per_group = [model.loss(tokens[r]) for r in rows]
        if taking_part:  # (none: the step's average failed, no weight moved; the schedule moves on)
            torch.stack([per_group[g] for g in taking_part]).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), job["trainer"]["gradient_clip_val"])
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()
        losses.append([loss.item() for loss in per_group])
    return losses


def test_the_replica_groups_replay_with_every_group_taking_part_is_the_one_process_run(base_job, reference_run):
    """The replay above, checked: all groups at every step is the one-process curve (rows split, losses averaged)."""
    steps = len(reference_run["losses"])
    replayed = replay(merge(base_job, {"model": {"decay_steps": steps}}), [[0, 1]] * steps, dp=1)
    assert max(abs(sum(pair) / 2 - ref) for pair, ref in zip(replayed, reference_run["losses"])) <= 1e-5


@pytest.mark.parametrize(
    ("environment", "said"),
    [
        ({}, "REPLICA_GROUP_ID=None must name this job's group, 0 to 1"),
        ({"REPLICA_GROUP_ID": "2"}, "REPLICA_GROUP_ID='2' must name this job's group, 0 to 1"),
        ({"REPLICA_GROUP_ID": "1"}, "TORCHFT_LIGHTHOUSE is not set"),
        ({"REPLICA_GROUP_ID": "0", "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:9"}, "cannot be reached"),
    ],
)
def test_a_replica_group_without_its_index_or_a_lighthouse_is_refused_in_one_line(environment, said, monkeypatch):
    for name in ("REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match="replica_groups=2") as error:
        this_group(2)
    assert said in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"replica_groups": 0}, "replica_groups=0 must be a number of groups >= 1"),
        ({"replica_groups": 2, "islands": 2, "data_parallel_size": 2}, "islands=2: each replica group is one DiLoCo"),
        ({"replica_groups": 2, "sync_every": 4, "outer_fragments": 2}, "outer_fragments=2: streaming DiLoCo across"),
    ],
)
def test_replica_group_settings_no_run_could_use_are_refused_naming_them(settings, said):
    with pytest.raises(ValueError, match=said):
        Parallelism(**settings)


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory) -> torch.Tensor:
    """`lit3d fit` of the same command on one process (tests/test_cli.py's)."""
    return fit_losses(tmp_path_factory.mktemp("one_process"))[0]


@pytest.mark.ranks
def test_two_replica_groups_through_lit3d_fit_with_the_docs_lighthouse_train_like_one_process(
    tmp_path, one_process_losses
):
    """docs/fault-tolerance.md's commands: ``torchft_lighthouse``, then each group's ``lit3d fit`` from a folder of its
    own (2 ranks, data parallel, forked: `helpers.FORK`). The groups start together and each step averages both, so
    the mean of the two groups' logged losses is the one-process curve of the same command; the bytes a rank sends to
    the other group in a step (`CommReport`'s ``replica`` axis) are the planner's."""
    port = free_port()
    lighthouse = _lighthouse_process(port, join_ms=10000, heartbeat_ms=5000)
    try:
        groups = []
        for group in (0, 1):
            folder = tmp_path / f"g{group}"
            folder.mkdir()
            env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}",
                   "REPLICA_GROUP_ID": str(group)}  # fmt: skip
            command = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", "tiny", *QUICK, "--trainer.devices=2",
                       "--trainer.strategy=Parallel3DStrategy", "--trainer.strategy.replica_groups=2", FORK,
                       "--trainer.callbacks+=lit3d.callbacks.CommReport"]  # fmt: skip
            groups.append(forked.start(command, cwd=folder, env=env, merge_output=True))
        codes = [group.wait(timeout=240) for group in groups]
        outputs = [group.stdout() for group in groups]
    finally:
        lighthouse.kill()
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "replica group 0 of 2: starting with 2 group(s)" in outputs[0], outputs[0][-3000:]
    runs = [tmp_path / f"g{group}" / "runs" / "tiny" / "version_0" for group in (0, 1)]
    for run in runs:
        steps = [json.loads(line) for line in (run / RECORD_FILE).read_text().splitlines()][1:]
        took_part = [(s["step"], s["participants"], s["committed"]) for s in steps]
        assert took_part == [(i, 2, True) for i in range(4)], outputs[0][-3000:]
    rows = [words for words in map(str.split, outputs[0].splitlines()) if len(words) == 4]
    (row,) = [words for words in rows if words[0] == "replica"]  # CommReport's table
    assert float(row[1]) > 0 and row[3] == "1.000", row  # the bytes sent to the other group: the planner's
    losses = torch.tensor([logged(run, "train_loss") for run in runs]).mean(0)
    torch.testing.assert_close(losses, one_process_losses, rtol=1e-5, atol=0)


def test_the_planner_prices_the_replica_groups_average_over_the_network_each_step():
    """One group's plan (the nodes given) and the same with 4 replica groups: the groups' all-reduce of what each rank's
    optimizer steps (ZeRO-1's slice of its TP shard, fp32), over the network, in the step time."""
    from lit3d.parallel.layout import Layout
    from lit3d.parallel.zero import ZeroPolicy
    from lit3d.planner import Cluster, Training, estimate
    from lit3d.planner.tensors import rank_tensors, stepped_numel

    config, layout = GPTConfig.from_name("llama-8b"), Layout(dp=4, tp=8, pp=1, devices_per_node=8)
    plans = {groups: estimate(config, Cluster(nodes=4), layout, Training(global_batch_size=64),
                              Parallelism(zero_stage=1, replica_groups=groups)) for groups in (None, 4)}  # fmt: skip
    settings = Parallelism(zero_stage=1, replica_groups=4)
    stepped = stepped_numel(rank_tensors(config, 1, 1, 0, "loop"), layout, ZeroPolicy.of(settings, layout))
    assert plans[4].communication_per_step["replica"]["bytes"] == 2 * 3 / 4 * stepped * 4
    assert "replica" not in plans[None].communication_per_step
    slower = plans[4].step_time_s - plans[None].step_time_s
    seconds = plans[4].communication_per_step["replica"]["seconds"]
    assert seconds > 0 and slower == pytest.approx(seconds, rel=1e-6)  # nothing hides it


def test_lit3d_plan_shows_the_groups_and_what_a_rejoin_loads(capsys):
    """`lit3d plan --replica_groups 4`: the groups, each this layout launched apart, and the weights and optimizer
    state a group that rejoins loads a GPU (what the rejoin test above measures a restarted group loading)."""
    from lit3d.cli import main
    from lit3d.planner.units import size

    flags = ["plan", "--model", "llama-8b", "--nodes", "2", "--tensor_parallel_size", "8", "--pipeline_parallel_size",
             "1", "--global_batch_size", "256"]  # fmt: skip
    main([*flags, "--replica_groups", "4"])
    printed = capsys.readouterr().out
    assert "replica groups: 4, each this layout launched apart (REPLICA_GROUP_ID 0-3)" in printed, printed
    main([*flags, "--replica_groups", "4", "--json"])
    plan = json.loads(capsys.readouterr().out)
    rejoin = plan["memory_per_gpu"]["params"] + plan["memory_per_gpu"]["optimizer"]
    assert f"a group that rejoins loads {size(rejoin)} a GPU from a live one" in printed
    main(flags)
    assert "replica groups" not in capsys.readouterr().out


def test_the_rank_map_of_replica_groups_is_group_0_s_and_says_so():
    from lit3d.planner import Cluster, Request, plan
    from lit3d.planner.estimate import Training

    settings = Parallelism(tensor_parallel_size=8, pipeline_parallel_size=1)
    training, cluster = Training(global_batch_size=256), Cluster(nodes=2, gpus_per_node=8)
    for groups in (4, None):
        request = Request(GPTConfig.from_name("llama-8b"), cluster, training, replace(settings, replica_groups=groups),
                          frozenset({"tensor_parallel_size", "pipeline_parallel_size", "replica_groups"}))  # fmt: skip
        (picture,) = plan(request).rank_maps()
        heading = picture._heading(*picture._drawn())
        shown = "replica group 0 of 4 shown (REPLICA_GROUP_ID 0-3): each group runs this layout on nodes of its own"
        assert (shown in heading) == (groups == 4), heading
        assert heading.startswith("16 GPUs = dp 2 x tp 8 x pp 1 on 2 node(s)")  # one group's
