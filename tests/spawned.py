"""Run several training jobs in one group of spawned CPU ranks (gloo), and collect what each logged.

Starting Python processes is the slow part on a small machine, so one spawn serves every job of a world
size: each job is a fresh model, datamodule and Trainer over the same process group, one after another.

A job is a dict: ``model`` (GPT kwargs, ``config`` as a dict), ``data`` (TextDataModule kwargs), ``trainer``
(Trainer kwargs), ``strategy`` (Parallel3DStrategy kwargs; absent = a single-process run), and probes:
``plain_loader`` (feed a plain shuffled DataLoader, so Lightning must inject the sampler) and ``count_comms`` (count
collectives per training batch); ``checkpoint_every`` (save ``ckpts/step=N.ckpt`` every N steps; ``checkpoint_at``:
at step N only, the one a later job resumes from, without the saves after it), ``ckpt_path``
(resume from it; ``job:NAME/ckpts/step=N.ckpt``: from an earlier job of the same spawn), ``expect_error`` (record
the exception each rank raises instead of failing), ``callbacks`` (more callbacks, picklable), ``loss_scale`` (fp32
compute with fp16's loss scaling at this fixed scale: gradients must come out unscaled), ``unseeded`` (no
``seed_everything``: each rank seeds itself apart) and ``validate_after_fit`` and ``test_after_fit`` (then
``trainer.validate`` / ``test`` in the same processes); ``save_after_fit`` (then, as a script's last lines,
``trainer.save_checkpoint`` to ``after_fit.ckpt``, and each rank's keys of ``lightning_module_state_dict()``);
``user_module`` (kwargs of `user_modules.ParallelisesItself`, trained on `user_modules.RegressionData` instead of the
GPT) and ``lightning_strategy`` (``strategy`` holds `ModelParallelStrategy`'s arguments instead); ``data_class``:
``"chat"`` for `ChatDataModule` (``data`` its arguments); ``same_ranks``: run in the processes of the job before it
(`jobs_per_spawn`).
"""

import copy
import json
import os
import socket
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.multiprocessing as mp
from forked import START_METHOD
from helpers import logged
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader
from turns import ranks_turn

from lit3d import GPT, GPTConfig
from lit3d.callbacks import CommReport
from lit3d.data import ChatDataModule, TextDataModule
from lit3d.strategies import Parallel3DStrategy
from lit3d.strategies.optim.dtypes import SplitModelMixedPrecision
from lit3d.strategies.telemetry.held_memory import memory_by_component

# NOTE: ranks are forked from a server process that has imported torch, Lightning and lit3d once for the session
# (`forked.PRELOAD`; it has started no thread), instead of each spawned rank importing them again: about 7 s of one
# core per rank, and 1 s more for what each rank imports at its first job (HuggingFace datasets, the pipeline
# schedules, FSDP2, DCP).


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# NOTE: ranks are started afresh every few jobs (`jobs_per_spawn`). Each fit builds its device meshes, and each mesh
# dim is a new gloo process group with three threads of its own (two ``pt_gloo_runloop``, one ``gloo_tcp_loop``) that
# nothing ends while torch's caches hold the old meshes (DTensor treats equal meshes as one; destroying the groups does
# not end them either, measured), and idle they still take CPU: measured, 100 idle groups took 0.85 s of CPU per rank
# in 5 s of sleep, and a DP2 x TP2 job took 6-11 s beside them against 2.4 s without. Each start costs a warm-up too
# (DTensor's first sharding propagations: 2-5 s). Measured alone on 2 cores: the 99 jobs of 2 ranks took 212 s at 8
# jobs a start and 190 s at 25; the 36 of 4 ranks (which make more groups a job) 151 s at 8 and 259 s all in one.
def jobs_per_spawn(world: int) -> int:
    return 25 if world <= 2 else 8


def run_jobs(world: int, jobs: dict[str, dict[str, Any]], out_dir: Path, deadline: float = 600) -> dict[str, dict]:
    """Run ``jobs`` on ``world`` spawned ranks, in order, `jobs_per_spawn` jobs per start of the ranks (a job may
    resume from an earlier one's checkpoint: ``job:NAME/...``); per job: rank 0's result plus ``ranks`` (every rank's
    probes).

    Fails (and kills the ranks) if no job has finished in ``deadline`` seconds: nothing may hang, however many jobs
    one spawn runs (a spawn of many jobs takes longer than any one of them may).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    chunks: list[dict[str, dict]] = []
    for name, job in jobs.items():  # (a ``same_ranks`` job stays with the one before it)
        if not chunks or (len(chunks[-1]) >= jobs_per_spawn(world) and not job.get("same_ranks")):
            chunks.append({})
        chunks[-1][name] = job
    return {name: result for chunk in chunks for name, result in _start(world, chunk, out_dir, deadline).items()}


def _start(world: int, jobs: dict[str, dict[str, Any]], out_dir: Path, deadline: float) -> dict[str, dict]:
    """`_run_jobs` on fresh ranks, started again on another port if the first was taken."""
    for attempt in range(3):
        try:
            return _run_jobs(world, jobs, out_dir, deadline)
        except mp.ProcessRaisedException as error:
            # NOTE: `free_port` hands out a port that was free; another process of the machine (the other xdist
            # worker's ranks, a command a test starts) can take it before rank 0 listens on it. Then start again on
            # another port: nothing of the jobs ran (every rank fails at the rendezvous, before the first job).
            if "EADDRINUSE" not in str(error) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_jobs(world: int, jobs: dict[str, dict[str, Any]], out_dir: Path, deadline: float) -> dict[str, dict]:
    context = mp.start_processes(
        _worker, args=(world, free_port(), jobs, str(out_dir)), nprocs=world, start_method=START_METHOD, join=False
    )
    finished, progress = 0, time.time()
    while not context.join(timeout=5):
        now_finished = sum((out_dir / name / f"rank{world - 1}.json").exists() for name in jobs)
        if now_finished > finished:
            finished, progress = now_finished, time.time()
        elif time.time() - progress > deadline:
            for process in context.processes:
                process.kill()
            waiting = [name for name in jobs if not (out_dir / name / f"rank{world - 1}.json").exists()]
            raise TimeoutError(f"no job finished in {deadline} s; still to finish: {waiting}")
    results = {}
    for name in jobs:
        ranks = [json.loads((out_dir / name / f"rank{r}.json").read_text()) for r in range(world)]
        results[name] = {**ranks[0], "ranks": ranks}
    return results


def _worker(rank: int, world: int, port: int, jobs: dict, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        SPAWNED_RANK=str(rank),
        HF_DATASETS_DISABLE_PROGRESS_BARS="1",
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    # NOTE: one process group for every job of these ranks (a strategy ends only a group it started itself).
    dist.init_process_group("gloo", rank=rank, world_size=world)
    share_mesh_groups()
    for name, job in jobs.items():
        with ranks_turn(f"{Path(out_dir).name}/{name} ({world} ranks)"):  # (one group at a time: `turns`)
            started = time.perf_counter()
            # (a copy: the job's own callbacks would otherwise keep its trainer, model and optimizer alive)
            result = run_job(copy.deepcopy(job), Path(out_dir) / name, devices=world)
            result["seconds"] = time.perf_counter() - started
        (Path(out_dir) / name).mkdir(parents=True, exist_ok=True)  # (a job refused at its start made none)
        (Path(out_dir) / name / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():  # leave together, and join gloo's threads now rather than at interpreter exit
        dist.barrier()
        dist.destroy_process_group()


# NOTE: every gloo group runs a thread that wakes each 10 ms (its TCP loop's epoll timeout), and a fit's meshes make
# 4-7 groups, which nothing ends (above): measured, 100 idle groups take 0.8 s of a core per rank in 5 s. So the jobs of
# one start of the ranks share their mesh dims' groups: a group with the same ranks, timeout and backend as an earlier
# job's is handed out again instead of a new one (the same members, so the same collectives; the jobs run one after
# another). Measured alone on 2 cores: the jobs of 2 ranks took 309 core-s without and 268 with, those of 4 ranks
# 280-292 without and 248-252 with. (This replaces, in these test ranks only, the name `DeviceMesh` creates its
# groups with; a lit3d run has one fit per process and so nothing to share.)
def share_mesh_groups() -> None:
    """Inside spawned ranks: `DeviceMesh` reuses the groups an earlier job's meshes made (`new_group`, by ranks)."""
    import torch.distributed.device_mesh as device_mesh

    made, create = {}, device_mesh.new_group

    def new_or_made(ranks=None, timeout=None, backend=None, pg_options=None, **kwargs):
        if ranks is None or pg_options is not None:  # (not one `DeviceMesh` asks for: made afresh)
            return create(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options, **kwargs)
        key = (tuple(ranks), timeout, backend)
        if key not in made:
            made[key] = create(ranks=ranks, timeout=timeout, backend=backend, **kwargs)
        return made[key]

    device_mesh.new_group = new_or_made


def run_job(job: dict, job_dir: Path, devices: int = 1) -> dict:
    if job.get("expect_error"):
        try:
            _run_job(job, job_dir, devices)
        except Exception as error:
            return {"error": f"{type(error).__name__}: {error}"}
        return {"error": None}
    return _run_job(job, job_dir, devices)


def _run_job(job: dict, job_dir: Path, devices: int) -> dict:
    if job.get("unseeded"):
        os.environ.pop("PL_GLOBAL_SEED", None)  # what an earlier job's seed_everything left
        torch.manual_seed(100 + int(os.environ.get("LOCAL_RANK", 0)))
    else:
        L.seed_everything(job.get("seed", 1234))
    if "user_module" in job:  # a module written for ModelParallelStrategy (tests/user_modules.py)
        import user_modules

        kwargs = dict(job["user_module"])
        module_class = getattr(user_modules, kwargs.pop("class", "ParallelisesItself"))
        data_class = user_modules.TokenData if module_class is user_modules.LlamaTP else user_modules.RegressionData
        model, data = module_class(**kwargs), data_class()
    else:
        model_kwargs = dict(job.get("model", {}))
        model = GPT(GPTConfig(**model_kwargs.pop("config")), **model_kwargs)
        data_class = ChatDataModule if job.get("data_class") == "chat" else TextDataModule
        if "fed_by" in job:  # batches from a plain DataLoader or a user's data module (tests/user_modules.py)
            import user_modules

            data = user_modules.fed_data(model.config.vocab_size, job["fed_by"], **job["data"])
        else:
            data = (PlainLoaderData if job.get("plain_loader") else data_class)(**job["data"])
    strategy_class = ModelParallelStrategy if job.get("lightning_strategy") else Parallel3DStrategy
    strategy = strategy_class(**job["strategy"]) if "strategy" in job else "auto"
    callbacks = [Probe(count_comms=job.get("count_comms", False)), *job.get("callbacks", [])]
    if "checkpoint_every" in job:
        callbacks.append(
            ModelCheckpoint(
                dirpath=str(job_dir / "ckpts"),
                filename="{step}",
                save_top_k=-1,
                every_n_train_steps=job["checkpoint_every"],
            )
        )
    if "checkpoint_at" in job:
        callbacks.append(SaveAt(job_dir / "ckpts", job["checkpoint_at"]))
    logger = CSVLogger(str(job_dir), name="log", version=0)
    nodes = job.get("nodes", 1)
    options = dict(
        accelerator="cpu",
        num_nodes=nodes,
        devices=(devices // nodes if "strategy" in job else 1),
        strategy=strategy,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing="checkpoint_every" in job,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    if "loss_scale" in job:
        options["plugins"] = [LossScaledFP32(job["loss_scale"])]
    if job.get("watch_launcher"):  # as if our launcher had started this rank (`LauncherWatch`)
        os.environ["LIT3D_LAUNCHER_PID"] = str(os.getppid())
    with simulated_nodes(nodes, devices):
        trainer = L.Trainer(**{**options, **job.get("trainer", {})})
        ckpt_path = job.get("ckpt_path")
        if isinstance(ckpt_path, str) and ckpt_path.startswith("job:"):  # another job's of the same spawn
            ckpt_path = str(job_dir.parent / ckpt_path.removeprefix("job:"))
        trainer.fit(model, data, ckpt_path=ckpt_path)
    os.environ.pop("LIT3D_LAUNCHER_PID", None)
    if job.get("leftovers"):  # what the fit left running or set (it should leave nothing)
        threads = [t.name for t in threading.enumerate() if t.name.startswith("lit3d")]
        leftovers = {"threads": threads, "env": sorted(k for k in os.environ if k.startswith("LIT3D"))}
    probe = callbacks[0]
    result = {
        "memory": probe.memory,
        "sampler": probe.sampler,
        "comms": probe.comms,
        "param_sum": sum(float(_local(p).detach().double().sum()) for p in model.parameters()),
        "job_dir": str(job_dir),
        "mesh": probe.mesh,
        "whole_param_sum": sum(float(_whole(p).detach().double().sum()) for p in model.parameters())
        if job.get("whole_param_sum")
        else None,
        "leftovers": leftovers if job.get("leftovers") else None,
    }
    for callback in callbacks:
        if isinstance(callback, CommReport):
            result["comm_bytes"] = {"measured": callback.measured, "planned": callback.planned}
        if hasattr(callback, "results"):  # a test's own probe (plain data)
            result.update(callback.results())
    if trainer.is_global_zero:
        log_dir = Path(logger.log_dir)
        result["losses"] = logged(log_dir, "train_loss")
        result["aux_loss"] = logged(log_dir, "moe/aux_loss")
        result["load_imbalance"] = logged(log_dir, "moe/load_imbalance")
        result["val_loss"] = logged(log_dir, "val_loss")
        result["pp_bubble"] = logged(log_dir, "pp/bubble")
        result["pp_bubble_theory"] = logged(log_dir, "pp/bubble_theory")
        result["qk_clip"] = {name: logged(log_dir, f"qk_clip/{name}") for name in ("max_logit", "clipped_heads")}
        result["plan_check"] = {
            name: logged(log_dir, f"plan/{name}") for name in ("peak_memory_ratio", "step_time_ratio")
        }
    if job.get("save_after_fit"):
        trainer.save_checkpoint(job_dir / "after_fit.ckpt")
        result["state_keys_after_fit"] = list(trainer.strategy.lightning_module_state_dict())
    if job.get("validate_after_fit"):
        result["validate_after_fit"] = trainer.validate(model, data, verbose=False)[0]["val_loss"]
    if job.get("test_after_fit"):
        result["test"] = trainer.test(model, data, verbose=False)[0]
    return result


@contextmanager
def simulated_nodes(nodes: int, devices: int):
    """``nodes`` nodes of ``devices / nodes`` ranks each: this rank's LOCAL_RANK and NODE_RANK as a launcher would set
    them (the process group is the same one)."""
    if nodes == 1:
        yield
        return
    rank, per_node = int(os.environ["SPAWNED_RANK"]), devices // nodes
    os.environ.update(LOCAL_RANK=str(rank % per_node), NODE_RANK=str(rank // per_node))
    try:
        yield
    finally:
        os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")


def _whole(tensor: torch.Tensor) -> torch.Tensor:  # (a collective for a DTensor: every rank calls it)
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class Probe(Callback):
    """Records the last step's memory report, the training sampler's replica settings and collectives per batch."""

    def __init__(self, count_comms: bool = False) -> None:
        self.count_comms, self.memory, self.sampler, self.comms = count_comms, {}, {}, []
        self.mesh: dict = {}
        self._mode = None

    def on_train_start(self, trainer, pl_module):
        mesh = getattr(trainer.strategy, "device_mesh", None) if hasattr(trainer.strategy, "_device_mesh") else None
        if mesh is not None:
            self.mesh = {"ranks": mesh.mesh.tolist(), "names": list(mesh.mesh_dim_names)}
        sampler = trainer.train_dataloader.sampler
        self.sampler = {
            "type": type(sampler).__name__,
            "num_replicas": getattr(sampler, "num_replicas", None),
            "rank": getattr(sampler, "rank", None),
            "batch_size": trainer.train_dataloader.batch_size,
        }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.count_comms:
            from torch.distributed.tensor.debug import CommDebugMode

            self._mode = CommDebugMode()
            self._mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.comms.append({str(op): n for op, n in self._mode.get_comm_counts().items()})
            self._mode = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == trainer.max_steps - 1 and hasattr(trainer.strategy, "memory_estimate"):
            self.memory = memory_by_component(trainer.lightning_module, trainer.strategy.optimizers)
            self.memory["estimate"] = trainer.strategy.memory_estimate


class SaveAt(Callback):
    """Saves ``folder/step=N.ckpt`` once, when training reaches step N (``checkpoint_at``)."""

    def __init__(self, folder: Path, step: int) -> None:
        self.folder, self.step, self.saved = folder, step, False

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step and not self.saved:
            trainer.save_checkpoint(self.folder / f"step={self.step}.ckpt")
            self.saved = True


class LossScaledFP32(SplitModelMixedPrecision):
    """fp16's loss scaling (a GradScaler whose scale stays ``scale``) around fp32 compute: exact powers of two, so
    the run must train exactly like an unscaled one."""

    def __init__(self, scale: float) -> None:
        super().__init__("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=10**6))

    def autocast_context_manager(self):
        return nullcontext()


class PlainLoaderData(TextDataModule):
    """The same blocks behind a plain shuffled DataLoader: Lightning itself must add the distributed sampler."""

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.micro_batch_size(), shuffle=True, drop_last=True)
