"""The rank map as a picture: nodes × GPUs, each GPU labelled with its (t, p) coordinate, coloured by stage.

Small fleets are drawn whole (each cell also names its replica d). A large fleet repeats the same pattern for
every data-parallel replica, so only the nodes that hold replica d = 0 are drawn, with the replica count in
the title. A tensor-parallel group that spans nodes is outlined in red: its traffic leaves the fast link.

``RankMap(layout)`` shows itself in a notebook (``_repr_svg_``) and ``save``s as ``.svg``, ``.png`` or
``.html``. Drawing needs matplotlib (``pip install "lit3d[plot]"``).
"""

from __future__ import annotations

import io
from pathlib import Path

from lit3d.strategies.layout import Layout

MAX_NODES = 32  # rows drawn at most


class RankMap:
    def __init__(self, layout: Layout, title: str = "") -> None:
        self.layout = layout
        self.title = title

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
            from matplotlib.patches import Rectangle
        except ImportError as error:
            raise ImportError('drawing the rank map needs matplotlib: pip install "lit3d[plot]"') from error
        layout = self.layout
        nodes, one_replica = self.nodes_drawn()
        gpus = layout.devices_per_node
        crossing = {r for group in layout.tp_groups_across_nodes() for r in group}
        colours = plt.get_cmap("tab20" if layout.pp > 10 else "tab10")
        fig, ax = plt.subplots(figsize=(1.0 + 0.9 * gpus, 0.9 + 0.55 * len(nodes)))
        for row, node in enumerate(nodes):
            for gpu in range(gpus):
                rank = node * gpus + gpu
                if rank >= layout.world_size:
                    continue
                d, t, p = layout.coordinate(rank)
                shown = not one_replica or d == 0
                ax.add_patch(
                    Rectangle(
                        (gpu, -row - 1),
                        0.94,
                        0.9,
                        facecolor=colours(p % colours.N) if shown else "#eeeeee",
                        edgecolor="red" if rank in crossing else "white",
                        linewidth=2.5 if rank in crossing else 1,
                    )
                )
                label = f"t{t} p{p}" if one_replica else f"t{t} p{p}\nd{d}"
                ax.text(gpu + 0.47, -row - 0.55, label if shown else f"d{d}", ha="center", va="center", fontsize=7)
        ax.set_xlim(0, gpus)
        ax.set_ylim(-len(nodes), 0)
        ax.set_xticks([g + 0.47 for g in range(gpus)], [f"gpu {g}" for g in range(gpus)], fontsize=7)
        ax.set_yticks([-r - 0.55 for r in range(len(nodes))], [f"node {n}" for n in nodes], fontsize=7)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        heading = (
            f"{layout.world_size} GPUs = dp {layout.dp} x tp {layout.tp} x pp {layout.pp} on "
            f"{layout.num_nodes} node(s); colour = pipeline stage"
        )
        if one_replica:
            heading += f"\nreplica d=0 shown; the other {layout.dp - 1} replicas repeat it on their own GPUs"
        if layout.num_nodes > len(nodes) and not one_replica:
            heading += f"\nfirst {len(nodes)} of {layout.num_nodes} nodes shown"
        if crossing:
            heading += "\nred: tensor-parallel group spans nodes (slow)"
        ax.set_title((self.title + "\n" if self.title else "") + heading, fontsize=8)
        fig.tight_layout()
        return fig

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
