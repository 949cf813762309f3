"""The rank map as a picture: nodes × devices, each cell a rank with its global number, (t, p) coordinate and, given
the planner's estimate, the memory it holds; coloured by pipeline stage. Several layouts can be drawn one above the
other, each with its memory, step time and the traffic on each link, to answer "which layout, and why"; the picture
keeps a page's width (eight devices per row) so that it stays readable when shrunk.

Small fleets are drawn whole (each cell also names its replica d; with expert parallelism, e: which share of each
MoE layer's experts it holds). A large fleet repeats the same pattern for
every data-parallel replica, so only the nodes that hold replica d = 0 are drawn, with the replica count in
the title. A tensor-parallel group that spans nodes is outlined in red: its traffic leaves the fast link.

``RankMap(layout)`` shows itself in a notebook (``_repr_svg_``) and ``save``s as ``.svg``, ``.png`` or
``.html``; ``RankMap.side_by_side([...])`` does the same for several. Drawing needs matplotlib
(``pip install "lit3d[plot]"``).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lit3d.parallel.layout import Layout
from lit3d.planner.units import plural, size

if TYPE_CHECKING:
    from lit3d.planner.estimate import Plan

MAX_NODES = 32  # nodes drawn at most
COLUMNS = 8  # devices per row of the picture; a wider node wraps (a GB200 NVL72 "node" is 72 GPUs)
CELL_WIDTH, CELL_HEIGHT = 1.1, 0.75  # inches: room for three 8-point lines
DPI = 150  # of a saved .png
GOLDEN = (5**0.5 - 1) / 2
KIND_COLOURS = ("#7fb3e6", "#f3b36b", "#9fd89a", "#d9a3e0")  # a fleet's GPU kinds, in the order they come
KIND_NAMES = ("blue", "orange", "green", "violet")


def stage_colour(stage: int) -> tuple[float, float, float]:
    """The colour of pipeline stage ``stage``: hues a golden-ratio turn apart (never equal, neighbours far apart),
    light and darker in turn; distinct for every stage count a map draws (tested to 128)."""
    import colorsys

    return colorsys.hls_to_rgb((stage * GOLDEN) % 1.0, 0.78 if stage % 2 else 0.6, 0.65)


class RankMap:
    """The rank map of one layout.

    Args:
        layout: The rank grid.
        title: A heading above the map.
        plan: The planner's estimate of the layout: each cell then shows its stage's memory, and the heading the
            step time and the traffic on each link.
        device: What one rank runs on, for the labels (``GPU``, or ``CPU process`` for a rehearsal on CPU).
        kinds: A fleet's GPU kind of each node (`lit3d.planner.fleet`): the cells are then coloured by kind.
        replica_groups: Fault-tolerant replica groups (torchft) that each run this layout on nodes of their own: the
            map is group 0's, and its heading says so.
    """

    def __init__(
        self,
        layout: Layout,
        title: str = "",
        plan: Plan | None = None,
        device: str = "GPU",
        kinds: list[str] | None = None,
        replica_groups: int = 1,
    ) -> None:
        self.layout, self.title, self.plan, self.device, self.kinds = layout, title, plan, device, kinds
        self.replica_groups = replica_groups
        self._maps = [self]

    @classmethod
    def side_by_side(cls, maps: list[RankMap]) -> RankMap:
        """One picture of several maps, one above the other (e.g. the best layouts of a search)."""
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
        nodes = sorted({layout.node(layout.rank(p=p, t=t)) for p in range(layout.pp) for t in range(layout.tp)})
        return nodes[:MAX_NODES], True

    def figure(self):
        """The maps stacked top to bottom, each at most `COLUMNS` cells wide: the picture keeps a page's width."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as error:
            raise ImportError('drawing the rank map needs matplotlib: pip install "lit3d[plot]"') from error
        columns = max(min(m.layout.devices_per_node, COLUMNS) for m in self._maps)
        heights = [1.3 + 0.2 * m._heading(*m._drawn()).count("\n") + CELL_HEIGHT * len(m._rows()) for m in self._maps]
        fig, axes = plt.subplots(
            len(self._maps),
            1,
            figsize=(1.2 + CELL_WIDTH * columns, sum(heights)),
            squeeze=False,
            gridspec_kw={"height_ratios": heights},
        )
        for ax, one in zip(axes[:, 0], self._maps):
            one._draw(ax, columns)
        fig.tight_layout()
        return fig

    def _drawn(self) -> tuple[bool, int, set[int]]:
        """(only replica d = 0 shown, nodes drawn, ranks of tensor-parallel groups that span nodes): the heading's."""
        nodes, one_replica = self.nodes_drawn()
        return one_replica, len(nodes), {r for group in self.layout.tp_groups_across_nodes() for r in group}

    def _rows(self) -> list[tuple[int, int]]:
        """(node, first slot) of each drawn row: a node wider than `COLUMNS` devices wraps onto more rows."""
        per_node = self.layout.devices_per_node
        return [(node, slot) for node in self.nodes_drawn()[0] for slot in range(0, per_node, COLUMNS)]

    def _draw(self, ax, columns: int) -> None:
        from matplotlib.patches import Rectangle

        layout = self.layout
        one_replica, nodes_drawn, crossing = self._drawn()
        rows, per_node = self._rows(), layout.devices_per_node
        for row, (node, first) in enumerate(rows):
            for slot in range(first, min(first + COLUMNS, per_node)):
                rank = node * per_node + slot
                if rank >= layout.world_size:
                    continue
                p, d, c, t = layout.coordinate(rank)
                shown = not one_replica or d == 0
                edge = ("red", 2.5) if rank in crossing else ("white", 1)
                colour = self._colour(node, p) if shown else "#eeeeee"
                x = slot - first
                ax.add_patch(
                    Rectangle((x, -row - 1), 0.94, 0.9, facecolor=colour, edgecolor=edge[0], linewidth=edge[1])
                )
                label = f"r{rank}\nt{t} p{p}" + (f" c{c}" if layout.cp > 1 else "") + ("" if one_replica else f" d{d}")
                label += f" e{d % layout.ep}" if layout.ep > 1 else ""
                label += f" i{layout.island(rank)}" if layout.islands > 1 else ""
                if self.plan is not None and shown:
                    label += "\n" + size(self.plan.memory_by_stage[p]["total"])
                ax.text(x + 0.47, -row - 0.55, label if shown else f"d{d}", ha="center", va="center", fontsize=8)
        ax.set_xlim(0, columns)
        ax.set_ylim(-len(rows), 0)
        wraps = per_node > COLUMNS  # then a row names its devices, a column the place in the row
        ticks = [f"+{g}" if wraps else f"{self.device} {g}" for g in range(columns)]
        ax.set_xticks([g + 0.47 for g in range(columns)], ticks, fontsize=8)
        last = lambda first: min(first + COLUMNS, per_node) - 1
        names = [f"node {node}" + (f", {first}-{last(first)}" if wraps else "") for node, first in rows]
        ax.set_yticks([-r - 0.55 for r in range(len(rows))], names, fontsize=9)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        heading = self._heading(one_replica, nodes_drawn, crossing)
        ax.set_title((self.title + "\n" if self.title else "") + heading, fontsize=9)

    def _colour(self, node: int, stage: int) -> Any:
        """A cell's colour: its pipeline stage's, or on a fleet its node's GPU kind's (in the order they come)."""
        if self.kinds is None:
            return stage_colour(stage)
        return KIND_COLOURS[list(dict.fromkeys(self.kinds)).index(self.kinds[node]) % len(KIND_COLOURS)]

    def _heading(self, one_replica: bool, nodes_drawn: int, crossing: set[int]) -> str:
        layout = self.layout
        ep = f" (ep {layout.ep} within dp)" if layout.ep > 1 else ""
        dp = f"{layout.dp}{ep}" + (f" x cp {layout.cp}" if layout.cp > 1 else "")
        lines = [
            f"{layout.world_size} {plural(self.device)} = dp {dp} x tp {layout.tp} x pp {layout.pp} on "
            f"{layout.num_nodes} node(s); colour = pipeline stage"
        ]
        if self.kinds is not None:
            names = list(dict.fromkeys(self.kinds))
            legend = ", ".join(f"{name} {KIND_NAMES[i % len(KIND_NAMES)]}" for i, name in enumerate(names))
            lines[0] = lines[0].replace("colour = pipeline stage", f"colour = GPU kind ({legend})")
        if layout.islands > 1:
            lines[0] = lines[0].replace(" = ", f" = {layout.islands} DiLoCo islands (i) x ", 1)
        if self.replica_groups > 1:
            groups = self.replica_groups
            lines.append(
                f"replica group 0 of {groups} shown (REPLICA_GROUP_ID 0-{groups - 1}): each group runs this layout on "
                f"nodes of its own, launched apart; they average gradients each step (torchft), and a group that "
                f"fails is dropped and rejoins from a live one"
            )
        if layout.ep > 1:
            lines.append(
                f"e = share of each MoE layer's experts: expert-parallel groups of {layout.ep} consecutive d (ranks "
                f"{layout.tp * layout.cp} apart); the {layout.dp // layout.ep} groups hold the same experts"
            )
        if layout.dp_replicate > 1:
            lines.append(
                f"HSDP: ZeRO shards over groups of {layout.shard_size} consecutive d (d // {layout.shard_size} names "
                f"the group); the {layout.dp_replicate} groups all-reduce their shards once per step"
            )
        if layout.cp > 1:
            lines.append(
                f"c = place in the context-parallel ring (ranks {layout.tp} apart; each holds sequence chunks "
                f"c and {2 * layout.cp - 1}-c)"
            )
        if self.plan is not None:
            plan = self.plan
            memory = size(plan.memory_per_gpu["total"])
            step = f"step {plan.step_time_s:.3g} s, MFU {plan.mfu:.0%}, bubble {plan.pipeline_bubble:.1%}"
            lines.append(f"ZeRO-{plan.layout['zero_stage']}: {memory} per {self.device} at most, {step}")
            lines.append(
                ", ".join(
                    f"{axis} {size(c['bytes'])}/step on {c['link_gbps']:g} GB/s"
                    for axis, c in plan.communication_per_step.items()
                    if c["bytes"]
                )
            )
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
        fig.savefig(buffer, format=fmt, dpi=DPI)
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
