"""The layout planner behind ``lit3d plan``: memory, communication, bubble and step time of a layout on a
cluster (`estimate`), a search over layouts (`search`), an exact check against the real parallelisation on
the meta device (`verify`) and the rank map picture (`RankMap`)."""

from lit3d.planner.estimate import GB, PRECISIONS, Cluster, Plan, Training, estimate
from lit3d.planner.rankmap import RankMap
from lit3d.planner.report import format_plan, format_search
from lit3d.planner.search import Candidate, check_inputs, layout_problem, search
from lit3d.planner.verify import verify

__all__ = [
    "GB",
    "PRECISIONS",
    "Candidate",
    "Cluster",
    "Plan",
    "RankMap",
    "Training",
    "check_inputs",
    "estimate",
    "format_plan",
    "format_search",
    "layout_problem",
    "search",
    "verify",
]
