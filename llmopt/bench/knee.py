"""Pick the load level to run at from a sweep: the knee of the throughput-vs-latency curve.

As load rises (concurrency or request rate), throughput climbs and then saturates while latency keeps
growing: past the knee, extra load buys queueing delay, not throughput. Two rules:

1. With an SLO: the highest-throughput point that meets it (ties: the lower latency). If none meets it,
   there is no knee, and the recommendation says so.
2. Without one: *kneedle* (Satopaa et al., 2011) on the Pareto frontier. Points that another point beats
   on both axes (more latency for no more throughput, e.g. past overload collapse) are dropped first, so
   the remaining curve rises monotonically in both latency (x) and throughput (y). Both axes are
   min-max normalized to [0, 1]; the chord then runs from (0, 0) to (1, 1), and the knee is the point
   farthest *above* that chord, i.e. argmax(y_norm - x_norm) (proportional to the perpendicular
   distance). If no point rises at least `min_bend` above the chord, the curve is straight or bends the
   other way: throughput still scales with latency, the sweep never saturated, and we recommend its
   highest-throughput point while saying so.

Degenerate sweeps: one usable point is returned as is; a frontier of one point is the point that beats all
others on both axes: the lowest-latency one when more load bought nothing (flat throughput), or, when it is
the highest load measured, a sign that the sweep stopped before latency started to grow; a frontier of
two points has no curvature, so the higher-throughput one is returned with advice to sweep more levels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

KneeMethod = Literal["slo", "kneedle", "linear", "flat", "too_few_points", "single_point"]


class SweepPoint(BaseModel):
    """One load level of a sweep."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    x: float = Field(description="Concurrency or request rate; inf means everything at once.")
    throughput: float = Field(description="Output tokens per second.")
    latency_ms: float | None = Field(description="The chosen latency percentile (e.g. p99 TTFT), ms.")
    slo_met: bool | None = Field(None, description="Whether this level met the SLO; None without an SLO.")


class Knee(BaseModel):
    """The chosen point (None when nothing qualifies) and a one-line recommendation."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    method: KneeMethod
    index: int | None = Field(description="Index of the chosen point in the sweep as given.")
    point: SweepPoint | None
    recommendation: str
    bend: float | None = Field(None, description="Kneedle: normalized height above the chord at the knee.")


def format_load(x: float, x_kind: str) -> str:
    """`max concurrency 12`, `request rate 4 req/s`, or the everything-at-once forms for inf."""
    if x_kind == "concurrency":
        return "unbounded concurrency" if math.isinf(x) else f"max concurrency {x:g}"
    return "all requests at once" if math.isinf(x) else f"request rate {x:g} req/s"


def _fmt_rate(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _describe(p: SweepPoint, x_kind: str, latency_label: str) -> str:
    lat = "n/a" if p.latency_ms is None else f"{p.latency_ms:.0f} ms"
    return f"{format_load(p.x, x_kind)}: {_fmt_rate(p.throughput)} tok/s at {latency_label} {lat}"


def _verb(x: float, x_kind: str) -> str:
    if x_kind == "concurrency":
        return "run with"
    return "send" if math.isinf(x) else "run at"


def _usable(p: SweepPoint) -> bool:
    return p.latency_ms is not None and math.isfinite(p.latency_ms) and math.isfinite(p.throughput)


def _pareto(idx: list[int], points: Sequence[SweepPoint]) -> list[int]:
    """Indices not dominated in (lower latency, higher throughput), sorted by latency."""
    order = sorted(idx, key=lambda i: (points[i].latency_ms, -points[i].throughput, points[i].x))
    frontier: list[int] = []
    best = -math.inf
    for i in order:
        if points[i].throughput > best:
            frontier.append(i)
            best = points[i].throughput
    return frontier


def find_knee(
    points: Sequence[SweepPoint],
    *,
    x_kind: Literal["concurrency", "request_rate"] = "concurrency",
    latency_label: str = "p99 TTFT",
    min_bend: float = 0.05,
) -> Knee | None:
    """The knee of a sweep (see the module docstring); None for an empty sweep."""
    if not points:
        return None

    def knee(method: KneeMethod, i: int | None, text: str, bend: float | None = None) -> Knee:
        return Knee(method=method, index=i, point=None if i is None else points[i], recommendation=text, bend=bend)

    def run_with(i: int, suffix: str = "") -> str:
        return f"{_verb(points[i].x, x_kind)} {_describe(points[i], x_kind, latency_label)}{suffix}"

    usable = [i for i, p in enumerate(points) if _usable(p)]

    if any(p.slo_met is not None for p in points):
        ok = [i for i in usable if points[i].slo_met]
        if not ok:
            if usable:
                best = min(usable, key=lambda i: points[i].latency_ms)  # type: ignore[arg-type,return-value]
                hint = f" (lowest latency: {_describe(points[best], x_kind, latency_label)})"
            else:
                hint = ""
            return knee("slo", None, f"no load level met the SLO{hint}; lower the load or relax the SLO")
        i = max(ok, key=lambda j: (points[j].throughput, -(points[j].latency_ms or 0.0)))
        return knee("slo", i, run_with(i, " (highest throughput within the SLO)"))

    if not usable:
        return knee("single_point", None, "no load level completed a request; nothing to recommend")
    if len(usable) == 1:
        return knee("single_point", usable[0], run_with(usable[0], " (only one load level measured)"))

    frontier = _pareto(usable, points)
    if len(frontier) == 1:
        best = frontier[0]
        if points[best].x >= max(points[i].x for i in usable):  # the highest load beat every other level
            return knee("flat", best, run_with(best, " (it beat every lower load on both throughput and "
                                                     "latency; try higher load)"))
        return knee("flat", best, run_with(best, " (more load did not raise throughput)"))
    if len(frontier) == 2:
        return knee("too_few_points", frontier[-1],
                    run_with(frontier[-1], " (too few load levels to find a bend; sweep more)"))

    lat = [points[i].latency_ms for i in frontier]
    tput = [points[i].throughput for i in frontier]
    lat_lo, lat_span = lat[0], lat[-1] - lat[0]  # type: ignore[operator]
    tput_lo, tput_span = tput[0], tput[-1] - tput[0]
    heights = [
        (t - tput_lo) / tput_span - (la - lat_lo) / lat_span  # type: ignore[operator]
        for la, t in zip(lat, tput, strict=True)
    ]
    k = max(range(len(frontier)), key=lambda j: heights[j])
    if heights[k] < min_bend:
        return knee("linear", frontier[-1],
                    run_with(frontier[-1], " (throughput still scales with load; try higher load)"))
    return knee("kneedle", frontier[k], run_with(frontier[k]), bend=heights[k])
