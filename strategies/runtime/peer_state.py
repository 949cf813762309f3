"""What a live replica group hands a restarted one (`lit3d.strategies.runtime.replica_groups`), rank by rank: the
same group rank of every group holds the same shards, so each rank sends its own local tensors, as they are.

- the module's weights and buffers (each rank's shards), the optimizers' parameters where they are not the module's
  own (ZeRO-1's slices, their fp32 master copies under bf16-mixed) and states, and the learning-rate schedulers';
- with DiLoCo across the groups, its outer loop's anchor, momentum and count of inner steps (a group joins as a round
  starts: its weights are then the anchor's, its inner optimizer's states the live group's);
- joining at the start of its fit, also the fit loop's progress (the step, Lightning's counters) and the data module's
  position: the restarted group then reads the batch the live ones are at, as a run resumed from a checkpoint does.

NOTE: written here, not taken from torchft, which sends whatever ``state_dict`` callable it is given: its own
integrations (DDP, LocalSGD, DiLoCo) hand over a module and an optimizer, not a Lightning run's loops and data.
The tensors are handed by reference (torchft's HTTP transport serves them until the sender's ``should_commit``,
before its optimizer step changes them; under DiLoCo a one-float average holds the sender until the loads are done):
no copy of the state is made.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lit3d.errors import ConfigurationError


class PeerState:
    """The state of ``trainer``'s run that torchft's manager sends (`save`) and loads (`load`).

    Args:
        trainer: The fit's trainer.
        run: What the run is (`lit3d.strategies.runtime.replica_groups.run_of`): a state is loaded only from a run that
            is the same.
        outer: DiLoCo's outer loop (`lit3d.strategies.optim.diloco.OuterLoop`), or None.
    """

    def __init__(self, trainer: Any, run: str, outer: Any = None) -> None:
        self.trainer, self.run, self.outer = trainer, run, outer
        self.joining = True  # until the group's first quorum: a state loaded then carries the loop and data too
        self.loaded_step: int | None = None  # the step a state was loaded at (None: never)
        self.loaded_bytes = 0  # the bytes of the tensors it loaded

    def save(self) -> dict[str, Any]:
        trainer = self.trainer
        module = trainer.lightning_module
        own = {local_tensor(p).untyped_storage().data_ptr() for p in module.parameters()}  # (sent once, as weights)
        return {
            "module": {name: local_tensor(value) for name, value in module.state_dict().items()},
            "optimizers": [
                {
                    "params": [_unless_in(own, local_tensor(p)) for p in _params(opt)],
                    "state": _local_tree(opt.state_dict()),
                }
                for opt in trainer.optimizers
            ],
            "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "fit_loop": _as_saved_after_the_last_step(trainer.fit_loop.state_dict()),
            "data": trainer.datamodule.state_dict() if trainer.datamodule is not None else None,
            "step": trainer.global_step,
            "run": self.run,
            "outer": None if self.outer is None else (self.outer.state_tensors(), int(self.outer.inner_steps)),
        }

    @torch.no_grad()
    def load(self, state: dict[str, Any]) -> None:
        if state["run"] != self.run:
            raise ConfigurationError(
                f"this replica group runs {self.run}, the live group it would load from {state['run']}: every "
                "replica group runs the same command but for REPLICA_GROUP_ID"
            )
        trainer = self.trainer
        for name, value in trainer.lightning_module.state_dict().items():
            local_tensor(value).copy_(state["module"][name])
        for optimizer, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
            params = _params(optimizer)
            for param, value in zip(params, saved["params"], strict=True):
                if value is not None:  # (None: the module's own weight, loaded above)
                    local_tensor(param).copy_(value)
            optimizer.load_state_dict(_placed_like_params(saved["state"], params))
        for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)
        if self.outer is not None:
            tensors, inner_steps = state["outer"]
            if inner_steps % self.outer.sync_every:  # (a rejoin loads at a round's start; a resumed start may not)
                warnings.warn(
                    f"this replica group took a live group's state in the middle of a DiLoCo round (inner step "
                    f"{inner_steps}, rounds of {self.outer.sync_every}): its weights are now that island's, not its "
                    "own checkpoint's (torchft's init_sync, as the groups start); checkpoints saved at rounds' ends "
                    "(every_n_train_steps a multiple of sync_every) resume every island as it was",
                    stacklevel=2,
                )
            for mine, theirs in zip(self.outer.state_tensors(), tensors, strict=True):
                mine.copy_(theirs)
            self.outer.inner_steps.fill_(inner_steps)
        if self.joining and state["step"] > 0:  # before the fit loop runs: it starts where the live groups are
            trainer.fit_loop.load_state_dict(state["fit_loop"])
            if trainer.datamodule is not None and state["data"] is not None:
                trainer.datamodule.load_state_dict(state["data"])
        self.loaded_step = state["step"]
        self.loaded_bytes = tensor_bytes([state["module"], state["optimizers"], state["outer"]])


def _as_saved_after_the_last_step(loop_state: dict[str, Any]) -> dict[str, Any]:
    """The fit loop's state, taken in the middle of a step (the quorum before its closure), as Lightning reads a
    checkpoint's: Lightning's resume counts the logged steps (``_batches_that_stepped``) one further, for the step a
    checkpoint was saved in, so the count here is one less. The progress of the batch under way (ready, not yet
    completed) is what a resume resets: the joining group starts with that batch."""
    epoch_loop = dict(loop_state["epoch_loop.state_dict"])
    epoch_loop["_batches_that_stepped"] -= 1
    return {**loop_state, "epoch_loop.state_dict": epoch_loop}


def tensor_bytes(value: Any) -> int:
    """The bytes of every tensor in ``value`` (dicts, lists and tuples of them)."""
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(item) for item in value)
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _unless_in(storages: set[int], tensor: torch.Tensor) -> torch.Tensor | None:
    return None if tensor.untyped_storage().data_ptr() in storages else tensor


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's local tensor, sharing its storage), or ``tensor`` itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _local_tree(value: Any) -> Any:
    """``value`` (an optimizer's state dict) with each DTensor replaced by this rank's local tensor."""
    if isinstance(value, dict):
        return {key: _local_tree(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_local_tree(item) for item in value)
    return local_tensor(value) if isinstance(value, torch.Tensor) else value


def _placed_like_params(state_dict: dict[str, Any], params: list[torch.Tensor]) -> dict[str, Any]:
    """An optimizer state dict of local tensors made DTensors again where its parameter is one (the moments of a
    sharded weight), so that the optimizer steps as it did before."""
    state = {
        index: {key: _placed_like(value, params[index]) for key, value in entry.items()}
        for index, entry in state_dict["state"].items()
    }
    return {"state": state, "param_groups": state_dict["param_groups"]}


def _placed_like(value: Any, param: torch.Tensor) -> Any:
    if not (isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0):
        return value  # a plain parameter's state, or a scalar (AdamW's step)
    if value.shape != param._local_tensor.shape:
        return value
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())  # fmt: skip
