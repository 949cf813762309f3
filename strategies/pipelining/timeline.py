"""A picture of one pipeline step: stages × time, each forward (F), backward (B) and weight-gradient (W)."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import Callback

from lit3d.parallel.schedules import SCHEDULES
from lit3d.parallel.stages import stage_rank

COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def plot_timeline(
    events: list[tuple[int, str, int, float, float]],
    path: str | Path,
    title: str = "",
    pipeline_ranks: int | None = None,
    placement: str = "loop",
) -> Path:
    """Draw ``(stage, kind, micro-batch, start_s, end_s)`` events (any number of ranks) to a PNG/SVG file.

    One row per pipeline rank (stage ``s`` runs on rank `stage_rank` of ``s``, ``pipeline_ranks`` and ``placement``;
    default: one row per stage); each box is labelled with its stage and micro-batch; white is the bubble.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = pipeline_ranks or max(e[0] for e in events) + 1
    owner = {e[0]: stage_rank(e[0], ranks, placement) for e in events}
    rows = sorted(set(owner.values()))
    interleaved = len({e[0] for e in events}) > len(rows)
    end = max(e[4] for e in events)
    fig, ax = plt.subplots(figsize=(max(6.0, min(16.0, 1.2 * len(events) ** 0.5 * 2)), 0.6 * len(rows) + 1.2))
    for stage, kind, microbatch, start, stop in events:
        row = rows.index(owner[stage])
        ax.broken_barh(
            [(start, stop - start)],
            (row - 0.4, 0.8),
            facecolors=COLOURS.get(kind, "grey"),
            edgecolor="white",
            linewidth=0.5,
        )
        if stop - start > end / 60:
            label = f"{kind}{microbatch}" + (f"/{stage}" if interleaved else "")
            ax.text((start + stop) / 2, row, label, ha="center", va="center", fontsize=6, color="white")
    names = {r: sorted({s for s in owner if owner[s] == r}) for r in rows}
    ax.set_yticks(range(len(rows)), [f"rank {r} (stage {', '.join(map(str, names[r]))})" for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("seconds into the step")
    ax.set_title(title or "one pipeline step (white = idle)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, ["forward", "backward", "weight grad"], loc="upper right", fontsize=7, ncol=3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class PipelineTimeline(Callback):
    """Saves a picture of one training step of the pipeline schedule (ranks × time) in the log folder.

    Args:
        step: The optimizer step to draw (the first steps also set the pipeline up).
        filename: Written under the trainer's ``log_dir``.
    """

    def __init__(self, step: int = 5, filename: str = "pipeline_timeline.png") -> None:
        self.step, self.filename, self.done = step, filename, False

    def wants(self, trainer) -> bool:
        """Whether the coming step is the one to draw (the strategy times the schedule only then)."""
        return not self.done and trainer.global_step + 1 >= self.step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import torch.distributed as dist

        pipeline = getattr(trainer.strategy, "pipeline", None)
        if pipeline is None or self.done or trainer.global_step < self.step:
            return
        self.done = True
        timelines = [None] * pipeline.pp_mesh.size()
        dist.all_gather_object(timelines, pipeline.clock.timeline(), group=pipeline.group)
        log_dir = trainer.log_dir  # NOTE: a collective itself (rank 0 broadcasts it), so every rank asks
        if trainer.is_global_zero:
            path = Path(log_dir or ".") / self.filename
            events = [event for timeline in timelines for event in timeline]
            plot_timeline(
                events,
                path,
                f"{trainer.strategy.parallelism.pipeline_schedule}: step {trainer.global_step}",
                pipeline_ranks=pipeline.pp_mesh.size(),
                placement=SCHEDULES[trainer.strategy.parallelism.pipeline_schedule].placement,
            )
            print(f"pipeline timeline: {path}")
