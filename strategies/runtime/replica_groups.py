"""Fault-tolerant replica groups on torchft: `Parallel3DStrategy(replica_groups=R)`.

Each group is a whole copy of the run's layout, launched as a job of its own (its own torchrun, SLURM step or
``lit3d fit``, its own process group), told its index by ``REPLICA_GROUP_ID`` and the lighthouse's address by
``TORCHFT_LIGHTHOUSE`` (torchft's names). Inside a group every axis runs as without groups (TP, PP, CP, EP, ZeRO);
across the groups, data parallelism goes through torchft's `Manager`, one per rank, which asks the lighthouse every
step which groups take part. Each optimizer step (`ReplicaGroups.step`):

1. the quorum, synchronous (``use_async_quorum=False``): a group that rejoins has loaded a live group's state before it
   computes anything, and takes part in that same step;
2. the closure (forward, backward, the group's own gradient reduction: ZeRO's reduce-scatter, DP's all-reduce);
3. the gradients this rank's optimizer steps on, averaged over the groups that take part (`Manager.allreduce`: the
   sum over the participants over their number; each group rank with the same rank of the others, which holds the
   same shards): the update a run fed only the participants' batches would make;
4. the optimizer steps only where the group agrees the step is good (`Manager.should_commit`); a step whose average
   failed (a group died during it) changes no weight, in every group (the schedule and the data move on).

With ``sync_every > 1`` each group is one of DiLoCo's islands (`lit3d.strategies.optim.diloco`), and the groups meet
once a round: its quorum as it starts (`before_inner_step`: a group joins then, when every group's weights are the
anchor), the inner steps inside each group, and at the outer step the average of the pseudo-gradients over the groups
that reach it (`average_outer`); a group lost in the round fails that average in every group, and the others average
again over a quorum that only shrinks.

The data: ``global_batch_size`` is the whole job's. Group ``g`` reads the rows of data-parallel replicas ``g*dp`` to
``g*dp + dp - 1`` of ``R*dp`` (`Parallel3DStrategy.distributed_sampler_kwargs`). The rows of a group that is missing
are skipped, not read again later. Rank 0 of each group writes ``replica_groups.jsonl`` beside its logs, a line a
step (its epoch and batch, the groups that took part, whether it committed) and a line for each join, from which
the samples trained on follow.

Joining: a fresh run's first step waits for every group (up to the strategy's ``timeout``); a group that starts while
the others are ahead (a restart by torchrun's elastic agent or SLURM's requeue) loads a live group's state in its
first quorum (`lit3d.strategies.runtime.peer_state.PeerState`): weights, optimizer states, schedules, the step and the
data position, sent by torchft's checkpoint transport (HTTP) from the same rank of a live group. No checkpoint is read.

Every group must run the same command: the same layout, model and precision (`run_of`). A group loads a live group's
state in its first quorum even when the run starts (torchft's ``init_sync``: the groups after the first take its
weights), so a group whose run differs is refused there, naming both runs (`PeerState.load`); the others go on.

NOTE: torchft's pieces used as they are: the lighthouse, `Manager` (quorum, reconfigured process groups, healing,
commit), its process groups and checkpoint transport. Not used: its DDP and FSDP wrappers (lit3d's own data
parallelism stays inside a group; only the optimizer's gradients cross groups, once a step, in one flat buffer per
dtype) and `OptimizerWrapper` (Lightning calls the optimizer with its closure inside; the quorum must come before it).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lit3d.errors import ConfigurationError
from lit3d.strategies.runtime.peer_state import PeerState, local_tensor

GROUP_VARIABLE, LIGHTHOUSE_VARIABLE = "REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE"  # torchft's names
RECORD_FILE = "replica_groups.jsonl"


def run_of(strategy: Any, trainer: Any) -> str:
    """What this rank of every group must share with the same rank of the others: the layout, the parameters it
    holds (global sizes), the precision and DiLoCo's settings."""
    held = sum(p.numel() for p in trainer.lightning_module.parameters())
    layout = f"{strategy.layout.grid} on {strategy.world_size} rank(s)"
    p = strategy.parallelism
    diloco = (
        f", DiLoCo every {p.sync_every} steps (outer lr {p.outer_lr}, momentum {p.outer_momentum}, "
        f"{p.outer_reduce_dtype})"
        if p.sync_every > 1
        else ""
    )
    return f"{layout}, {held:,} parameters, precision {trainer.precision}{diloco}"


def this_group(groups: int) -> tuple[int, str]:
    """This job's group and the lighthouse's address, or a one-line refusal naming what is missing (before any rank
    starts talking: the launcher's check)."""
    if importlib.util.find_spec("torchft") is None:
        raise ConfigurationError(f"replica_groups={groups} needs torchft: pip install torchft (with its lighthouse)")
    raw = os.environ.get(GROUP_VARIABLE)
    if raw is None or not raw.isdigit() or int(raw) >= groups:
        raise ConfigurationError(
            f"replica_groups={groups}: {GROUP_VARIABLE}={raw!r} must name this job's group, 0 to {groups - 1} "
            "(set it in each group's launch: docs/fault-tolerance.md)"
        )
    address = os.environ.get(LIGHTHOUSE_VARIABLE)
    if not address:
        raise ConfigurationError(
            f"replica_groups={groups}: {LIGHTHOUSE_VARIABLE} is not set; start the lighthouse "
            f"(torchft_lighthouse --min_replicas 1) and set {LIGHTHOUSE_VARIABLE}=http://HOST:29510"
        )
    url = urlparse(address if "://" in address else f"http://{address}")
    try:
        with socket.create_connection((url.hostname or "localhost", url.port or 29510), timeout=5):
            pass
    except OSError as error:
        raise ConfigurationError(
            f"replica_groups={groups}: the lighthouse {LIGHTHOUSE_VARIABLE}={address!r} cannot be reached ({error}); "
            "start it first (torchft_lighthouse --min_replicas 1)"
        ) from None
    return int(raw), address


class ReplicaGroups:
    """This rank's torchft manager for one fit, and what each step asks of it (see the module's doc).

    Args:
        manager: torchft's `Manager` of this rank.
        state: What the manager sends a joining group and loads from a live one.
        groups: The job's groups (``replica_groups``).
        group: This job's group.
        record: The file rank 0 of the group writes each step's line to (None on other ranks).
    """

    def __init__(
        self,
        manager: Any,
        state: PeerState,
        groups: int,
        group: int,
        record: Path | None,
        lighthouse: str = "",
        timeout_s: float = 600.0,
    ) -> None:
        self.manager, self.state, self.groups, self.group, self.record = manager, state, groups, group, record
        self.lighthouse, self.timeout_s = lighthouse, timeout_s
        self._quorum_open = False  # a quorum asked for and not yet used by a step
        self.planned_rejoin_bytes: int | None = None  # what the planner says a rejoin loads per rank

    @classmethod
    def join(cls, strategy: Any, trainer: Any) -> ReplicaGroups:
        """Start this rank's manager and take part in the first quorum (loading a live group's state, if any)."""
        # NOTE: torchft's Rust side logs each quorum and commit at INFO, several lines a step on every rank; the
        # console keeps to what a user reads (RUST_LOG=info shows them). It reads the variable when first imported.
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        groups = strategy.parallelism.replica_groups
        group, lighthouse = this_group(groups)
        timeout = strategy.parallelism.timeout
        # NOTE: NCCL between groups on GPUs (not run on this project's CPU machines: the gloo path is what is tested)
        pg = ProcessGroupNCCL(timeout=timeout) if strategy.root_device.type == "cuda" else ProcessGroupGloo(timeout)
        state = PeerState(trainer, run_of(strategy, trainer), strategy.optimizer_steps.outer_loop)
        environment = strategy.cluster_environment
        manager = Manager(
            pg=pg, load_state_dict=state.load, state_dict=state.save, min_replica_size=1, use_async_quorum=False,
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, rank=strategy.global_rank,
            world_size=strategy.world_size, store_addr=environment.main_address, store_port=environment.main_port,
            lighthouse_addr=lighthouse, replica_id=f"lit3d_group_{group}",
        )  # fmt: skip
        folder = Path(trainer.log_dir or trainer.default_root_dir)
        record = folder / RECORD_FILE if strategy.global_rank == 0 else None
        joined = cls(manager, state, groups, group, record, lighthouse, timeout.total_seconds())
        plan = strategy.plan  # (the strategy's estimate of this run, made just before: `start_plan`)
        joined.planned_rejoin_bytes = plan.rejoin_bytes() if plan is not None else None
        try:
            joined._first_quorum(timeout.total_seconds())
        except BaseException:
            joined.stop()  # (its heartbeats end: the others go on without this group)
            raise
        return joined

    def _first_quorum(self, timeout_s: float) -> None:
        """The quorum of the fit's first step. A fresh run waits for every group, up to ``timeout_s``; a group joining
        a run under way loads a live group's state here.

        NOTE: asked again at once, not after a pause: the lighthouse answers a quorum as soon as its last members ask
        again, with whoever is asking then, so a group that paused between its asks would be left out of every one."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.manager.start_quorum()
            waiting = self.manager.num_participants() < self.groups and self.manager.current_step() == 0
            decided = [waiting and time.monotonic() < deadline]  # (rank 0's: the group's ranks ask again together)
            torch.distributed.broadcast_object_list(decided, src=0)
            if not decided[0]:
                break
        self.state.joining = False
        self._quorum_open = True
        # What the group's ranks loaded: torchft picks each rank's source among the live groups (the same rank of one),
        # and may have some ranks of a starting group load (a fresh run's `init_sync`). The bytes are the most loaded
        # rank's, as the planner counts; the step is Lightning's (torchft's leaves out the steps not committed).
        every: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, (self.state.loaded_step, self.state.loaded_bytes))
        steps = [loaded_step for loaded_step, _ in every if loaded_step is not None]
        recovered, step, loaded = bool(steps), max(steps, default=0), max(size for _, size in every)
        participants, planned = self.manager.num_participants(), self.planned_rejoin_bytes
        if recovered and step > 0:
            said = f"; planned {planned / 1e6:.2f} MB" if planned is not None else ""
            rank_zero_info(
                f"replica group {self.group}: rejoined at step {step} with a live group's state "
                f"({loaded / 1e6:.2f} MB on its most loaded rank{said})"
            )
        else:
            rank_zero_info(f"replica group {self.group} of {self.groups}: starting with {participants} group(s)")
        self._write(event="joined", step=step, participants=participants, recovered=recovered,
                    loaded_bytes=loaded, planned_bytes=planned)  # fmt: skip

    def step(self, optimizer: Any, closure: Callable[[], Any], inner_step: Callable[[Callable[[], Any]], Any]) -> Any:
        """One optimizer step across the groups: quorum, closure, the gradients' average, the step if committed."""
        if not self._quorum_open:
            self._quorum()
        self._quorum_open = False
        result = closure()
        grads = [
            local_tensor(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        ]
        self._average(grads)
        committed = self.manager.should_commit()
        if not committed:  # (every group skips it: no weight moves; the data and the schedule go on)
            error = self.manager.errored()
            rank_zero_warn(
                f"replica group {self.group}: step {self.state.trainer.global_step} not committed: {_said(error)}"
            )
        self._note(self.manager.num_participants(), committed)
        return inner_step(lambda: result) if committed else result

    def before_inner_step(self, starts_round: bool) -> None:
        """Before an inner step of DiLoCo across the groups (``sync_every > 1``: each group an island). As a round
        starts, the quorum of the groups that train it: a group that joins loads a live group's state then, when every
        group holds the anchor's weights, and a one-float average holds the live groups until it has loaded it (torchft
        serves the state by reference, and the next inner step changes it). The inner step itself stays in the group."""
        if starts_round:
            if not self._quorum_open:
                self._quorum()
            self.manager.allreduce(torch.zeros(1)).wait()  # (an error here fails the round's outer step, as a death)
        self._quorum_open = False
        self._note(self.manager.num_participants(), True)

    def average_outer(self, pseudo_gradient: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """DiLoCo's outer step across the groups: the mean of ``pseudo_gradient()`` over the groups that reach it. A
        group that failed during the round (or during this average) fails the average in every group; the others
        then meet again without it (a quorum that only shrinks: no group joins in the middle of a round) and average
        once more, until one commits or the strategy's ``timeout`` has passed since the first failure (a failure seen
        only by a collective's timeout takes that long itself).

        None: this group's average failed where another group's committed (a ring broken by a dying group may end
        on some of the others), and the quorum asked again, the next round's of the group that committed, gave this
        group that group's state (after its outer step: the anchor stepped, the weights the anchor's). The caller
        then takes no outer step of its own; the round's quorum is open for the next inner step."""
        trainer, deadline = self.state.trainer, None
        step = trainer.global_step
        while True:
            flat = pseudo_gradient()
            self.manager.allreduce(flat).wait()  # (the sum over the participants over their number)
            committed, participants = self.manager.should_commit(), self.manager.num_participants()
            self._write(event="outer", step=step, participants=participants, committed=committed)
            if committed:
                trainer.lightning_module.log("replica_groups/outer_participants", float(participants), on_step=True,
                                             on_epoch=False, rank_zero_only=True)  # fmt: skip
                return flat
            deadline = deadline or time.monotonic() + self.timeout_s
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"replica group {self.group}: the outer step after step {step} did not commit within the "
                    f"strategy's timeout: {_said(self.manager.errored())}"
                )
            rank_zero_warn(
                f"replica group {self.group}: the outer step after step {step} failed ({_said(self.manager.errored())}"
                "); averaging again over the groups still alive"
            )
            if self._healed_in_shrinking_quorum(trainer):
                self._write(event="outer", step=step, participants=self.manager.num_participants(), committed=False,
                            healed=True)  # fmt: skip
                return None

    def _healed_in_shrinking_quorum(self, trainer: Any) -> bool:
        """Ask for a quorum that only shrinks; whether it gave this group a group's state that had committed the
        outer step (torchft heals a group whose step is behind). Its schedulers stay this group's own: the state
        was taken after the other group's step had ended, and Lightning ends this one's still."""
        before = self.manager.current_step()
        kept = [copy.deepcopy(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs]
        self._quorum(shrink_only=True)
        if self.manager.current_step() == before:
            return False
        for config, state in zip(trainer.lr_scheduler_configs, kept, strict=True):
            config.scheduler.load_state_dict(state)
        self._quorum_open = True
        return True

    def _quorum(self, shrink_only: bool = False) -> None:
        """Ask for the step's quorum; torchft's error (a gRPC status) said as what it means here."""
        try:
            self.manager.start_quorum(shrink_only=shrink_only)
        except Exception as error:  # (torchft raises a TimeoutError or a RuntimeError carrying a gRPC status)
            raise RuntimeError(
                f"replica group {self.group}: no quorum at step {self.state.trainer.global_step} within the strategy's "
                f"timeout: the lighthouse at {self.lighthouse} did not answer (is it still running?): {error}"
            ) from error

    def _note(self, participants: int, committed: bool) -> None:
        """Log the step's groups and commit (``replica_groups/*``), and write its line of the record."""
        trainer = self.state.trainer
        for name, value in (("participants", participants), ("committed", committed)):
            trainer.lightning_module.log(f"replica_groups/{name}", float(value), on_step=True, on_epoch=False,
                                         rank_zero_only=True)  # fmt: skip
        batch = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # (this step's, from 0 in its epoch)
        self._write(event="step", step=trainer.global_step, epoch=trainer.current_epoch, batch=batch,
                    participants=participants, committed=committed)  # fmt: skip

    def _average(self, grads: list[torch.Tensor]) -> None:
        """Average ``grads`` in place over the groups that take part: one flat buffer per dtype."""
        for dtype in dict.fromkeys(g.dtype for g in grads):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            self.manager.allreduce(flat).wait()
            for grad, value in zip(same, flat.split([g.numel() for g in same]), strict=True):
                grad.copy_(value.view_as(grad))

    def _write(self, **line: Any) -> None:
        if self.record is not None:
            self.record.parent.mkdir(parents=True, exist_ok=True)
            with open(self.record, "a") as file:
                file.write(json.dumps({"group": self.group, **line}) + "\n")

    def stop(self) -> None:
        """End the manager (its heartbeats stop: the lighthouse drops this group at once)."""
        self.manager.shutdown(wait=False)


def _said(error: Any) -> str:
    """torchft's error (it carries the traceback in its text) in one line."""
    return str(error).strip().splitlines()[0] if error is not None else "no error recorded"
