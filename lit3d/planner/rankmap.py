"""The rank map as a picture: nodes × devices, each cell a rank with its global number, (t, p) coordinate and, given
the planner's estimate, the memory it holds; coloured by pipeline stage. Several layouts can be drawn side by side,
each with its memory, step time and the traffic on each link, to answer "which layout, and why".

Small fleets are drawn whole (each cell also names its replica d). A large fleet repeats the same pattern for
every data-parallel replica, so only the nodes that hold replica d = 0 are drawn, with the replica count in
the title. A tensor-parallel group that spans nodes is outlined in red: its traffic leaves the fast link.

``RankMap(layout)`` shows itself in a notebook (``_repr_svg_``) and ``save``s as ``.svg``, ``.png`` or
``.html``; ``RankMap.side_by_side([...])`` does the same for several. Drawing needs matplotlib
(``pip install "lit3d[plot]"``).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

from lit3d.strategies.layout import Layout

if TYPE_CHECKING:
    from lit3d.planner.estimate import Plan

MAX_NODES = 32  # rows drawn at most


class RankMap:
    """The rank map of one layout.

    Args:
        layout: The rank grid.
        title: A heading above the map.
        plan: The planner's estimate of the layout: each cell then shows its stage's memory, and the heading the
            step time and the traffic on each link.
        device: What one rank runs on, for the labels (``GPU``, or ``CPU process`` for a rehearsal on CPU).
    """

    def __init__(self, layout: Layout, title: str = "", plan: Plan | None = None, device: str = "GPU") -> None:
        self.layout, self.title, self.plan, self.device = layout, title, plan, device
        self._maps = [self]

    @classmethod
    def side_by_side(cls, maps: list[RankMap]) -> RankMap:
        """One picture of several maps, left to right (e.g. the best layouts of a search)."""
        if not maps:
            raise ValueError("no rank map to draw")
        combined = cls(maps[0].layout, maps[0].title, maps[0].plan, maps[0].device)
        combined._maps = list(maps)
        return combined

    def nodes_drawn(self) -> tuple[list[int], bool]:
        """Node indices to draw and whether only replica d = 0 is shown."""
        layout = self.layout
        if layout.num_nodes <= MAX_NODES // 2 or layout.dp == 1:
            return list(range(min(layout.num_nodes, MAX_NODES))), False
        nodes = sorted({layout.node(layout.rank(0, t, p)) for p in range(layout.pp) for t in range(layout.tp)})
        return nodes[:MAX_NODES], True

    def figure(self):
        try:
            import matplotlib.pyplot as plt
        except ImportError as error:
            raise ImportError('drawing the rank map needs matplotlib: pip install "lit3d[plot]"') from error
        rows = max(len(m.nodes_drawn()[0]) for m in self._maps)
        width = sum(1.0 + 0.9 * m.layout.devices_per_node for m in self._maps)
        fig, axes = plt.subplots(1, len(self._maps), figsize=(width, 1.6 + 0.6 * rows), squeeze=False)
        for ax, one in zip(axes[0], self._maps):
            one._draw(ax)
        fig.tight_layout()
        return fig

    def _draw(self, ax) -> None:
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle

        from lit3d.planner.report import size

        layout = self.layout
        nodes, one_replica = self.nodes_drawn()
        per_node = layout.devices_per_node
        crossing = {r for group in layout.tp_groups_across_nodes() for r in group}
        colours = plt.get_cmap("tab20" if layout.pp > 10 else "tab10")
        for row, node in enumerate(nodes):
            for slot in range(per_node):
                rank = node * per_node + slot
                if rank >= layout.world_size:
                    continue
                d, t, p = layout.coordinate(rank)
                c = layout.cp_rank(rank)
                shown = not one_replica or d == 0
                edge = ("red", 2.5) if rank in crossing else ("white", 1)
                colour = colours(p % colours.N) if shown else "#eeeeee"
                ax.add_patch(
                    Rectangle((slot, -row - 1), 0.94, 0.9, facecolor=colour, edgecolor=edge[0], linewidth=edge[1])
                )
                label = f"r{rank}\nt{t} p{p}" + (f" c{c}" if layout.cp > 1 else "") + ("" if one_replica else f" d{d}")
                label += f" i{layout.island(rank)}" if layout.islands > 1 else ""
                if self.plan is not None and shown:
                    label += "\n" + size(self.plan.memory_by_stage[p]["total"])
                ax.text(slot + 0.47, -row - 0.55, label if shown else f"d{d}", ha="center", va="center", fontsize=6)
        ax.set_xlim(0, per_node)
        ax.set_ylim(-len(nodes), 0)
        ax.set_xticks([g + 0.47 for g in range(per_node)], [f"{self.device} {g}" for g in range(per_node)], fontsize=6)
        ax.set_yticks([-r - 0.55 for r in range(len(nodes))], [f"node {n}" for n in nodes], fontsize=7)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title((self.title + "\n" if self.title else "") + self._heading(one_replica, len(nodes), crossing),
                     fontsize=7)  # fmt: skip

    def _heading(self, one_replica: bool, nodes_drawn: int, crossing: set[int]) -> str:
        from lit3d.planner.report import plural, size

        layout = self.layout
        cp = f" x cp {layout.cp}" if layout.cp > 1 else ""
        lines = [f"{layout.world_size} {plural(self.device)} = dp {layout.dp}{cp} x tp {layout.tp} x pp {layout.pp} on "
                 f"{layout.num_nodes} node(s); colour = pipeline stage"]  # fmt: skip
        if layout.islands > 1:
            lines[0] = lines[0].replace(" = ", f" = {layout.islands} DiLoCo islands (i) x ", 1)
        if layout.cp > 1:
            lines.append(f"c = place in the context-parallel ring (ranks {layout.tp} apart; each holds sequence chunks "
                         f"c and {2 * layout.cp - 1}-c)")  # fmt: skip
        if self.plan is not None:
            plan = self.plan
            memory = size(plan.memory_per_gpu["total"])
            step = f"step {plan.step_time_s:.3g} s, MFU {plan.mfu:.0%}, bubble {plan.pipeline_bubble:.1%}"
            lines.append(f"ZeRO-{plan.layout['zero_stage']}: {memory} per {self.device} at most, {step}")
            lines.append(", ".join(f"{axis} {size(c['bytes'])}/step on {c['link_gbps']:g} GB/s"
                                   for axis, c in plan.communication_per_step.items() if c["bytes"]))  # fmt: skip
        if one_replica:
            lines.append(f"replica d=0 shown; the other {layout.dp - 1} replicas repeat it")
        if layout.num_nodes > nodes_drawn and not one_replica:
            lines.append(f"first {nodes_drawn} of {layout.num_nodes} nodes shown")
        if crossing:
            lines.append("red: tensor-parallel group spans nodes (slow)")
        return "\n".join(line for line in lines if line)

    def _render(self, fmt: str) -> bytes:
        import matplotlib.pyplot as plt

        fig = self.figure()
        buffer = io.BytesIO()
        fig.savefig(buffer, format=fmt, dpi=150)
        plt.close(fig)
        return buffer.getvalue()

    def _repr_svg_(self) -> str:
        return self._render("svg").decode()

    def save(self, path: str | Path) -> Path:
        """Write the map as ``.svg``, ``.png`` or ``.html`` (chosen by the suffix)."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in (".svg", ".png", ".html"):
            raise ValueError(f"map file {str(path)!r} must end in .svg, .png or .html")
        path.parent.mkdir(parents=True, exist_ok=True)
        if suffix == ".html":
            svg = self._repr_svg_()
            path.write_text(
                f"<!doctype html>\n<html><head><meta charset='utf-8'><title>lit3d rank map</title></head>"
                f"<body>\n{svg[svg.index('<svg') :]}\n</body></html>\n"
            )
        else:
            path.write_bytes(self._render(suffix[1:]))
        return path
