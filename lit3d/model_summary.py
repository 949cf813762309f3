"""The model summary of `Lit3DCLI`: Lightning's table, counting the whole model in every layout (the pipeline stages'
counts summed), with what rank 0 holds beside it when the model is split; without Lightning's FLOPs column where it
counts none. (``lit3d.callbacks.ModelSummary`` names it too.)"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from lightning.pytorch.utilities.model_summary import ModelSummary as LayerTable
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from lightning.pytorch.utilities.rank_zero import rank_zero_info


class ModelSummary(LightningModelSummary):
    """Lightning's model summary (as a Rich table when Rich is installed), counting the whole model in every layout,
    with what this rank holds beside it when the model is split.

    Lightning counts the parameters a rank holds, each DTensor whole: a pipeline stage's blocks under PP2 (half the
    model), the whole model under TP2. Here ``Params`` and the totals are the whole model's (the pipeline stages'
    counts summed, `WholeModelTable`), and ``Params per Device`` is rank 0's share (its stage, its shards).
    """

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._max_depth:
            return
        table = WholeModelTable(pl_module, self._max_depth, pipeline_group(trainer.strategy))  # on every rank
        if not trainer.is_global_zero:
            return
        totals = (table.total_parameters, table.trainable_parameters, table.model_size, table.total_training_modes)
        data = table._get_summary_data()
        if table.total_flops or not _RICH_AVAILABLE:
            layout = RichModelSummary if _RICH_AVAILABLE else LightningModelSummary
            layout.summarize(data, *totals, table.total_flops, **self._summarize_kwargs)
        else:  # NOTE: Lightning counts FLOPs only for a module with an `example_input_array`
            summarize_without_flops([(n, c) for n, c in data if n != "FLOPs"], *totals, **self._summarize_kwargs)
        if table.split:
            rank_zero_info(
                f"Params per Device: rank 0 holds {get_human_readable_count(table.local_parameters)} of the model's "
                f"{get_human_readable_count(table.total_parameters)} parameters"
            )


def summarize_without_flops(
    data: list[tuple[str, list[str]]], total: int, trainable: int, size_mb: float, modes: dict[str, int], **kwargs: Any
) -> None:
    """Lightning's Rich model summary (`RichModelSummary.summarize`), without its FLOPs column and total: zero for
    every module without an ``example_input_array``, which says nothing (`Throughput` reports the run's MFU)."""
    from rich import get_console
    from rich.table import Table

    table = Table(header_style=kwargs.get("header_style", "bold magenta"))
    for name, _ in data:
        numbers = name in ("Params", "Params per Device", "In sizes", "Out sizes")
        table.add_column(name, justify="right" if numbers else "left", style="dim" if name == " " else None)
    for row in zip(*(column for _, column in data)):
        table.add_row(*row)
    grid = Table.grid(expand=True)
    grid.add_column()
    for label, value in (
        ("Trainable params", get_human_readable_count(trainable)),
        ("Non-trainable params", get_human_readable_count(total - trainable)),
        ("Total params", get_human_readable_count(total)),
        ("Total estimated model params size (MB)", f"{size_mb:,.3f}"),
        ("Modules in train mode", modes["train"]),
        ("Modules in eval mode", modes["eval"]),
    ):
        grid.add_row(f"[bold]{label}[/]: {value}")
    console = get_console()
    console.print(table)
    console.print(grid)


class WholeModelTable(LayerTable):
    """Lightning's table of a module's layers, its counts the whole model's: each parameter counted whole (a
    DTensor's global shape) and the counts of the pipeline ranks in ``group`` summed by layer name (each holds
    other blocks under the same names); what this rank holds is kept as ``local_parameters``."""

    def __init__(self, model: L.LightningModule, max_depth: int = 1, group: Any = None) -> None:
        super().__init__(model, max_depth)
        rows = {name: _counts(layer._module.parameters()) for name, layer in self._layer_summary.items()}
        trainable = _counts(p for p in model.parameters() if p.requires_grad)[0]
        mine = {"rows": rows, "total": _counts(model.parameters()), "trainable": trainable}
        stages = [mine]
        if group is not None:
            stages = [None] * dist.get_world_size(group)
            dist.all_gather_object(stages, mine, group=group)
        self._whole_rows = [sum(stage["rows"].get(name, (0, 0))[0] for stage in stages) for name in rows]
        self._local_rows = [local for _, local in rows.values()]
        self._whole_total = sum(stage["total"][0] for stage in stages)
        self._whole_trainable = sum(stage["trainable"] for stage in stages)
        self.local_parameters = mine["total"][1]

    @property
    def split(self) -> bool:
        """Whether this rank holds less than the whole model."""
        return self.local_parameters != self._whole_total

    @property
    def param_nums(self) -> list[int]:
        return self._whole_rows

    @property
    def total_parameters(self) -> int:
        return self._whole_total

    @property
    def trainable_parameters(self) -> int:
        return self._whole_trainable

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        arrays = super()._get_summary_data()
        if self.split:  # beside "Params", where DeepSpeed's summary puts what one device holds
            local = [*self._local_rows, self.local_parameters - sum(self._local_rows)]  # the last: outside any layer
            at = [name for name, _ in arrays].index("Params")
            local = local[: len(arrays[at][1])]
            arrays.insert(at + 1, ("Params per Device", [get_human_readable_count(n) for n in local]))
        return arrays


def pipeline_group(strategy: Any) -> Any:
    """The process group of this rank's pipeline stages, or None without pipeline parallelism."""
    meshes = getattr(strategy, "meshes", None)  # `lit3d.strategies.meshes.ParallelMeshes` (Parallel3DStrategy)
    return meshes.group("pp") if meshes is not None else None


def _counts(parameters: Any) -> tuple[int, int]:
    """(elements of the whole tensors, elements this rank holds) of ``parameters``; lazy ones are not counted yet."""
    parameters = [p for p in parameters if not torch.nn.parameter.is_lazy(p)]
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in parameters)
    return sum(p.numel() for p in parameters), local
