"""DiLoCo's islands in the planner: the outer step on the link between islands, against synchronous data
parallelism over the same link.

Synchronous DP across islands is counted at its best, hierarchically: gradients are reduced inside each island
as usual, and each rank all-reduces only its own slice (what its optimizer steps) with the ranks that hold it in
the other islands, every step. That is exactly what DiLoCo's outer step sends (`island_bytes_per_sync`), once per
``sync_every`` steps instead of every step: the bytes between islands fall ``sync_every`` times. (A flat ring over
every replica would send more over the slow link still.)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lit3d.models.config import GPTConfig
from lit3d.planner.estimate import Cluster, estimate, held_precision
from lit3d.planner.search import Candidate
from lit3d.planner.units import size


def versus_synchronous(config: GPTConfig, cluster: Cluster, candidate: Candidate) -> dict[str, Any]:
    """The outer step of ``candidate`` (a layout with ``islands > 1``) and what synchronous DP would cost instead:
    bytes each GPU sends to the other islands and seconds, per outer step (``sync_every`` inner steps)."""
    layout, training, settings, plan = candidate.layout, candidate.training, candidate.parallelism, candidate.plan
    h = settings.sync_every
    gradients = "bfloat16" if held_precision(training, settings, layout).reduce_bytes == 2 else "float32"
    each_step = replace(settings, sync_every=1, outer_reduce_dtype=gradients, outer_fragments=1)
    synchronous = estimate(config, cluster, layout, training, each_step)
    outer, every_step = plan.communication_per_step["island"], synchronous.communication_per_step["island"]
    return {
        "islands": layout.islands,
        "sync_every": h,
        "fragments": settings.outer_fragments,
        "link_gbps": cluster.inter_island_gbps,
        "latency_ms": cluster.inter_island_latency_ms,
        "outer_step_s": h * plan.step_time_s,
        "outer_sync_bytes": outer["bytes"] * h,  # per GPU, all fragments
        "outer_sync_peak_bytes": outer["bytes"] * h / settings.outer_fragments,
        "outer_sync_s": outer["seconds"] * h,
        "synchronous_bytes": every_step["bytes"] * h,  # per GPU over the same sync_every steps
        "synchronous_s": synchronous.step_time_s * h,
        "synchronous_mfu": synchronous.mfu,
        "traffic_saved": 1 - outer["bytes"] / every_step["bytes"],
        "speedup": synchronous.step_time_s / plan.step_time_s,
    }


def format_islands(comparison: dict[str, Any]) -> str:
    """The lines `lit3d plan` prints for DiLoCo's islands."""
    c = comparison
    fragments = f", streaming in {c['fragments']} fragments" if c["fragments"] > 1 else ""
    return "\n".join(
        [
            f"DiLoCo: {c['islands']} islands, an outer step every {c['sync_every']} inner steps{fragments}, over "
            f"{c['link_gbps']:g} GB/s per GPU and {c['latency_ms']:g} ms per hop between islands",
            f"  per outer step: {c['outer_step_s']:.1f} s ({c['sync_every']} inner steps and the sync); each GPU sends "
            f"{size(c['outer_sync_bytes'])} to the other islands in {c['outer_sync_s']:.2f} s"
            + (f" ({size(c['outer_sync_peak_bytes'])} at a time)" if c["fragments"] > 1 else ""),
            f"  synchronous DP over the same link: {c['synchronous_s']:.1f} s for the same {c['sync_every']} steps, "
            f"{size(c['synchronous_bytes'])} per GPU between islands (MFU {c['synchronous_mfu']:.1%})",
            f"  DiLoCo saves {c['traffic_saved']:.1%} of the traffic between islands "
            f"({c['synchronous_bytes'] / c['outer_sync_bytes']:.0f}x fewer bytes) and runs {c['speedup']:.2f}x as fast",
        ]
    )
