"""DiLoCo's islands as fault-tolerant replica groups (`replica_groups=2, sync_every=4`, docs/fault-tolerance.md).

Two groups of 2 ranks (data parallel inside, ZeRO-1), each an island that trains 4 inner steps alone and meets the
other at the outer step through torchft. Group 1 dies in its second outer step (before its average: group 0's average
fails, and group 0 averages again alone); group 0 trains on; group 1 is started again, loads group 0's state as a round
starts and rejoins. Both end with bitwise equal weights, and each group's logged losses are those of a one-process
replay of the same rounds (which islands trained and which were averaged).
"""

import copy
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import logged
from layouts import merge
from spawned import START_METHOD, free_port, run_job
from test_replica_groups import _records, kill_then_restart, logged_steps, wait_until

from lit3d import GPT, GPTConfig
from lit3d.callbacks import CommReport
from lit3d.data.text import TextDataModule
from lit3d.strategies.runtime.replica_groups import ReplicaGroups

H = 4  # inner steps a round
KILLED_AFTER = 2 * H  # group 1 dies in the outer step after this many steps (its second)
RANKS = 2


class Rounds(L.Callback):
    """Ends the fit after the second round that every group finished together once ``final`` exists (a file the test
    writes as it restarts group 1); a step some group is missing from is slowed by half a second, so that the
    restarted group catches up before the live one has run far alone (fp32's rounding grows with the steps). Saves
    this rank's weights at the end."""

    def __init__(self, final: str, weights: str) -> None:
        self.final, self.weights, self.together = final, weights, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        groups = trainer.strategy.optimizer_steps.replica_groups
        missing = groups.manager.num_participants() < groups.groups
        if trainer.global_step % H == 0 and not missing and Path(self.final).exists():
            self.together += 1
            trainer.should_stop = self.together == 2
        elif missing:
            time.sleep(0.5)

    def on_train_end(self, trainer, pl_module) -> None:
        local = {name: getattr(p, "_local_tensor", p).detach() for name, p in pl_module.named_parameters()}
        torch.save(local, self.weights)


def _dies_in_its_outer_step(replica_groups, pseudo_gradient):
    """Group 1's ranks killed as they enter the outer step after ``KILLED_AFTER`` inner steps (a failure injected)."""
    if replica_groups.state.trainer.global_step + 1 >= KILLED_AFTER:  # (the index of the step the outer one ends)
        os.kill(os.getpid(), signal.SIGKILL)
    return _average_outer(replica_groups, pseudo_gradient)


_average_outer = ReplicaGroups.average_outer


def _rank(index, plan, job, address, out, final):
    group, run, dies, rank, port = plan[index]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank),
                      NODE_RANK="0", REPLICA_GROUP_ID=str(group), TORCHFT_LIGHTHOUSE=address)  # fmt: skip
    torch.set_num_threads(1)
    if dies:  # (in this process only: the test injects the failure, as torchft's own tests do)
        ReplicaGroups.average_outer = _dies_in_its_outer_step
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    callbacks = [Rounds(final, str(Path(out) / run / f"weights{rank}.pt"))]
    if job.get("comm_report"):  # the bytes of a round's steps (4-7), mean per step
        callbacks.append(CommReport(step=H, steps=H, verbose=False))
    run_job({**job, "callbacks": callbacks}, Path(out) / run, RANKS)
    if job.get("comm_report") and rank == 0:
        report = callbacks[-1]
        (Path(out) / run / "comm.json").write_text(json.dumps({"measured": report.measured, "planned": report.planned}))
    dist.barrier()
    dist.destroy_process_group()


def _start(job, address, out, runs, final):
    plan = [
        (group, run, dies, rank, port) for group, run, dies in runs for port in [free_port()] for rank in range(RANKS)
    ]
    return mp.start_processes(_rank, args=(plan, job, address, str(out), str(final)), nprocs=len(plan),
                              start_method=START_METHOD, join=False)  # fmt: skip


def _job(base_job: dict) -> dict:
    return merge(base_job, {
        "strategy": {"zero_stage": 1, "replica_groups": 2, "sync_every": H, "timeout": timedelta(seconds=60)},
        "model": {"decay_steps": 200, "learning_rate": 3e-3},  # (fp32 rounding grows less over the rounds)
        "trainer": {"max_steps": 200, "limit_val_batches": 0},
    })  # fmt: skip


def _losses_are_the_replays(folder: Path, replayed: dict, runs: tuple = (("g0", 0), ("g1", 1))) -> None:
    for run, group in runs:
        got, steps = logged(folder / run / "log" / "version_0", "train_loss"), logged_steps(folder / run)
        worst = max(abs(loss - replayed[step][group]) for loss, step in zip(got, steps, strict=True))
        print(f"{run}: {len(steps)} steps, the replay's losses within {worst:.1e}")  # (-s shows it)
        assert steps and worst <= 1e-5


@pytest.mark.ranks
def test_diloco_replica_groups_send_what_the_planner_counts_and_follow_the_replay(base_job, lighthouse, tmp_path):
    """No failure: two rounds of both islands are the replay's, and the bytes a rank sends to the other group over a
    round (its ZeRO-1 slice's pseudo-gradient at the outer step and the one float as the round starts, a mean per
    step: `CommReport`'s ``replica`` axis) are the planner's."""
    job, final, deadline = {**_job(base_job), "comm_report": True}, tmp_path / "final", time.time() + 120
    final.touch()  # (`Rounds` ends the fit after two rounds together)
    started = _start(job, lighthouse, tmp_path, [(0, "g0", False), (1, "g1", False)], final)
    wait_until("the groups to finish", lambda: all(p.exitcode is not None for p in started.processes), deadline)
    assert [p.exitcode for p in started.processes] == [0] * 2 * RANKS
    outer = [(line["step"] + 1, line["participants"], line["committed"]) for line in _records(tmp_path / "g0")
             if line["event"] == "outer"]  # fmt: skip
    assert outer == [(H, 2, True), (2 * H, 2, True)]
    _losses_are_the_replays(tmp_path, replay(job, *[{H: [0, 1], 2 * H: [0, 1]}] * 2, rejoins={}))
    for run in ("g0", "g1"):
        comm = json.loads((tmp_path / run / "comm.json").read_text())
        assert comm["planned"]["replica"] > 0 and comm["measured"]["replica"] == comm["planned"]["replica"], comm


@pytest.mark.ranks
def test_diloco_replica_groups_survive_a_group_lost_in_an_outer_step_and_follow_the_replayed_rounds(
    base_job, lighthouse, tmp_path
):
    job = _job(base_job)
    final = tmp_path / "final"
    first = _start(job, lighthouse, tmp_path, [(0, "g0", False), (1, "g1_killed", True)], final)
    second = kill_then_restart(first, RANKS, tmp_path, final, lambda: _start(
        job, lighthouse, tmp_path, [(1, "g1", False)], final))  # fmt: skip
    assert [p.exitcode for p in first.processes[:RANKS] + second.processes] == [0] * 2 * RANKS

    records = {run: _records(tmp_path / run) for run in ("g0", "g1_killed", "g1")}
    steps0 = [line["step"] for line in records["g0"] if line["event"] == "step"]
    assert steps0 == list(range(len(steps0))) and len(steps0) % H == 0  # group 0 never stopped; it ended on a round
    outer0 = [line for line in records["g0"] if line["event"] == "outer"]  # (each after the step it names: + 1 done)
    failed = [line for line in outer0 if not line["committed"]]  # group 0's average as group 1 died: failed, once
    assert [(line["step"] + 1, line["participants"]) for line in failed] == [(KILLED_AFTER, 2)], outer0
    committed = {line["step"] + 1: line["participants"] for line in outer0 if line["committed"]}
    assert (
        list(committed) == list(range(H, len(steps0) + 1, H))
        and committed[KILLED_AFTER] == committed[KILLED_AFTER + H] == 1
    )
    (joined,) = [line for line in records["g1"] if line["event"] == "joined"]
    assert joined["recovered"] and joined["step"] % H == 0 and joined["step"] > KILLED_AFTER, joined
    assert joined["loaded_bytes"] == joined["planned_bytes"] > 0, joined  # weights, inner and outer states
    averaged1 = {line["step"] + 1 for line in records["g1"] if line["event"] == "outer" and line["committed"]}
    assert averaged1 == set(range(joined["step"] + H, len(steps0) + 1, H))
    assert all(committed[step] == 2 for step in averaged1)
    for rank in range(RANKS):  # the same slices, bitwise, after the last outer step
        ours, theirs = (torch.load(tmp_path / run / f"weights{rank}.pt") for run in ("g0", "g1"))
        assert all(torch.equal(ours[name], theirs[name]) for name in ours)

    averaged = {step: [0, 1] if step < KILLED_AFTER or step in averaged1 else [0] for step in committed}
    trained = {step: [0, 1] if step <= KILLED_AFTER or step in averaged1 else [0] for step in committed}
    _losses_are_the_replays(tmp_path, replay(job, trained, averaged, rejoins={joined["step"]: 1}))


def replay(job: dict, trained: dict, averaged: dict, rejoins: dict, dp: int = 2, groups: int = 2) -> dict:
    """One process, no Lightning: each group's model and inner optimizer; at each step each training island's loss on
    its rows of the global batch (then its inner step); after each round (``trained[step]``: the islands that trained
    the round ending at ``step``), the outer step of the mean of the pseudo-gradients of ``averaged[step]``'s islands
    (Nesterov SGD on the anchor), every island's weights set to it. ``rejoins[step]``: a group that copies group 0's
    inner state as the round at ``step`` starts. Returns {step: {group: loss}}."""
    L.seed_everything(job.get("seed", 1234))
    kwargs, settings = dict(job["model"]), job["strategy"]
    models = [GPT(GPTConfig(**kwargs.pop("config")), **kwargs)]
    models[0].configure_model()
    models += [copy.deepcopy(models[0]) for _ in range(groups - 1)]
    configured = [m.configure_optimizers() for m in models]
    inner = [(c["optimizer"], c["lr_scheduler"]["scheduler"]) for c in configured]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    momentum = settings.get("outer_momentum", 0.9)
    outer = torch.optim.SGD(anchor, lr=settings.get("outer_lr", 0.7), momentum=momentum, nesterov=momentum > 0)
    data = TextDataModule(**job["data"])
    data.data_parallel = (1, 0)
    data.setup("fit")
    losses, last = {}, max(trained)
    for step, batch in enumerate(data.train_dataloader()):
        if step == last:
            break
        round_end = (step // H + 1) * H
        if step % H == 0 and step in rejoins:  # (weights are the anchor's then: the inner state is what differs)
            g = rejoins[step]
            inner[g][0].load_state_dict(copy.deepcopy(inner[0][0].state_dict()))  # (else the moments are shared)
            inner[g][1].load_state_dict(inner[0][1].state_dict())
        tokens, losses[step] = batch["input_ids"], {}
        for g in trained[round_end]:
            rows = [i for i in range(len(tokens)) if i % (groups * dp) // dp == g]
            loss = models[g].loss(tokens[rows])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(models[g].parameters(), job["trainer"]["gradient_clip_val"])
            inner[g][0].step()
            inner[g][0].zero_grad()
            inner[g][1].step()
            losses[step][g] = loss.item()
        if step + 1 == round_end:
            with torch.no_grad():
                for a, *weights in zip(anchor, *(models[g].parameters() for g in averaged[round_end])):
                    a.grad = torch.stack([a - w for w in weights]).mean(0)
                outer.step()
                for model in models:
                    for a, w in zip(anchor, model.parameters()):
                        w.copy_(a)
    return losses


def test_the_planner_prices_diloco_replica_groups_once_a_round_and_a_rejoin_with_the_outer_state(capsys):
    """`lit3d plan --replica_groups 4 --sync_every 50`: the groups' all-reduce of the pseudo-gradients (fp32, what each
    rank's optimizer steps) and of the round's one float, once in 50 steps; the outer loop's anchor and momentum (fp32)
    in what a group that rejoins loads; the command that runs it."""
    from lit3d.cli import main

    flags = ["plan", "--model", "llama-8b", "--nodes", "2", "--tensor_parallel_size", "8", "--pipeline_parallel_size",
             "1", "--global_batch_size", "256", "--replica_groups", "4", "--json"]  # fmt: skip
    plans = []
    for every in (1, 50):
        main([*flags, "--sync_every", str(every)])
        plans.append(json.loads(capsys.readouterr().out))
    stepped = plans[0]["communication_per_step"]["replica"]["bytes"] / (2 * 3 / 4 * 4)  # (fp32 gradients, each step)
    assert plans[1]["communication_per_step"]["replica"]["bytes"] == pytest.approx(2 * 3 / 4 * (stepped * 4 + 4) / 50)
    outer = plans[1]["memory_per_gpu"]["optimizer"] - plans[0]["memory_per_gpu"]["optimizer"]
    assert outer == 2 * 4 * stepped  # the anchor and the momentum, fp32
    main(flags[:-1] + ["--sync_every", "50"])
    printed = capsys.readouterr().out
    assert "each a DiLoCo island, averaging pseudo-gradients every 50 steps" in printed
    assert "--trainer.strategy.sync_every=50" in printed and "--trainer.strategy.replica_groups=4" in printed


class ScriptedManager:
    """torchft's `Manager` as `ReplicaGroups.average_outer` uses it, scripted: each average's commit, how long it
    takes (a failure a collective's timeout finds), and whether the quorum asked after a failure heals this group
    (another group committed: torchft's step moves on)."""

    def __init__(self, commits: list[bool], seconds: float = 0.0, heals: bool = False, on_quorum=None) -> None:
        self.commits, self.seconds, self.heals, self.step, self.quorums = list(commits), seconds, heals, 5, []
        self.on_quorum = on_quorum or (lambda: None)  # (what a heal loads, say)

    def allreduce(self, flat):
        time.sleep(self.seconds)
        return SimpleNamespace(wait=lambda: flat)

    def should_commit(self) -> bool:
        return self.commits.pop(0)

    def num_participants(self) -> int:
        return 2

    def errored(self) -> str:
        return "a peer's connection closed\n(traceback)"

    def current_step(self) -> int:
        return self.step

    def start_quorum(self, shrink_only: bool = False) -> None:
        self.quorums.append(shrink_only)
        self.step += self.heals
        self.on_quorum()


def _groups(manager: ScriptedManager, timeout_s: float = 60.0):
    from lit3d.strategies.runtime.peer_state import PeerState

    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), lambda s: 1)
    trainer = SimpleNamespace(global_step=7, lightning_module=SimpleNamespace(log=lambda *a, **k: None),
                              lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)])  # fmt: skip
    return ReplicaGroups(manager, PeerState(trainer, "run"), 3, 1, None, timeout_s=timeout_s)


def test_a_replica_group_retries_its_outer_average_for_a_timeout_counted_from_its_first_failure():
    """An average that fails after longer than ``timeout`` (a dead peer a collective's timeout finds) is asked again
    over a quorum that only shrinks, and the second commits: the budget starts at the failure, not before it."""
    manager = ScriptedManager([False, True], seconds=0.3)
    assert torch.equal(_groups(manager, timeout_s=0.2).average_outer(lambda: torch.ones(3)), torch.ones(3))
    assert manager.quorums == [True]
    with pytest.raises(RuntimeError, match="did not commit within the strategy's timeout: a peer's connection closed$"):
        _groups(ScriptedManager([False, False, False], seconds=0.3), timeout_s=0.2).average_outer(lambda: torch.ones(3))


def test_a_replica_group_healed_by_a_group_that_committed_the_outer_step_takes_no_outer_step_of_its_own():
    """Its average failed where another group's committed; the quorum asked again heals it with that group's state
    (the anchor after the outer step): `average_outer` says so (None), keeps the group's own learning-rate schedule,
    leaves the quorum open for the next round, and `OuterLoop.sync` steps nothing, setting the weights to the anchor."""
    from lit3d.strategies.optim.diloco import OuterLoop

    manager = ScriptedManager([False], heals=True, on_quorum=lambda: setattr(scheduler, "last_epoch", 4))
    groups = _groups(manager)  # (a heal sets the schedule to the other group's, one step further)
    scheduler = groups.state.trainer.lr_scheduler_configs[0].scheduler
    weights = torch.zeros(4)
    loop = OuterLoop([lambda: weights], ["w"], [lambda t: t], None, 1, 4, lr=0.7, momentum=0.9)
    loop.anchor[0].fill_(2.0)  # (the committed group's anchor, as a heal loads it)
    weights.fill_(1.0)
    scheduler.last_epoch = 3
    loop.sync(0, groups)
    assert torch.equal(weights, torch.full((4,), 2.0)) and torch.equal(loop.anchor[0], torch.full((4,), 2.0))
    assert torch.equal(loop.optimizer.state[loop.anchor[0]]["momentum_buffer"], torch.zeros(4))  # no step taken
    assert scheduler.last_epoch == 3 and groups._quorum_open and manager.quorums == [True]


def test_a_group_whose_diloco_settings_differ_is_refused_naming_both_runs():
    """`run_of` carries DiLoCo's settings, so a group launched with another ``sync_every`` (or outer optimizer) is
    refused in its first quorum instead of meeting the others' collectives at other steps."""
    from lit3d.errors import ConfigurationError
    from lit3d.parallel.settings import Parallelism
    from lit3d.strategies.runtime.peer_state import PeerState
    from lit3d.strategies.runtime.replica_groups import run_of

    trainer = SimpleNamespace(lightning_module=torch.nn.Linear(2, 2), precision="32-true")
    runs = [
        run_of(SimpleNamespace(layout=SimpleNamespace(grid="dp 2 x tp 1 x pp 1"), world_size=2,
                               parallelism=Parallelism(replica_groups=2, sync_every=every)), trainer)
        for every in (4, 1)
    ]  # fmt: skip
    assert runs[0] == (
        "dp 2 x tp 1 x pp 1 on 2 rank(s), 6 parameters, precision 32-true, DiLoCo every 4 steps (outer lr 0.7, "
        "momentum 0.9, float32)"
    )
    with pytest.raises(ConfigurationError, match="DiLoCo every 4 steps .*the live group it would load from dp 2"):
        PeerState(None, runs[0]).load({"run": runs[1]})
