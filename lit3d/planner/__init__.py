"""The layout planner behind ``lit3d plan``: `plan(request) -> Report` plans a `Request` (a model on a `Cluster`, the
training loop's numbers and the run's `lit3d.parallel.Parallelism`, with what the user fixed): memory,
communication, bubble and step time of a layout (`estimate`; the time by `lit3d.planner.clock`, how the run's kernels
are written by `Software`), or of every layout of the cluster (`search`), an exact
check against the real parallelisation on the meta device (`verify`), the rank map picture (`RankMap`), a fleet of
GPU kinds in one job (`plan_fleet`), and a page of every layout to play with (`explore`)."""

from lit3d.planner.estimate import GB, PLANNING_DEFAULTS, PRECISIONS, Cluster, Plan, Training, estimate
from lit3d.planner.explore import explore
from lit3d.planner.fleet import parse_fleet
from lit3d.planner.fleet_report import FleetReport, format_fleet, plan_fleet
from lit3d.planner.inputs import Software
from lit3d.planner.rankmap import RankMap
from lit3d.planner.report import format_plan, format_search
from lit3d.planner.request import Report, Request, check_inputs, format_report, plan, planning_defaults
from lit3d.planner.search import Candidate, layout_problem, search
from lit3d.planner.verify import verify

__all__ = [
    "GB",
    "PLANNING_DEFAULTS",
    "PRECISIONS",
    "Candidate",
    "Cluster",
    "FleetReport",
    "Plan",
    "RankMap",
    "Report",
    "Request",
    "Software",
    "Training",
    "check_inputs",
    "estimate",
    "explore",
    "format_fleet",
    "format_plan",
    "format_report",
    "format_search",
    "layout_problem",
    "parse_fleet",
    "plan",
    "plan_fleet",
    "planning_defaults",
    "search",
    "verify",
]
