"""The knee finder on synthetic sweeps: saturation, overload collapse, SLOs and degenerate sweeps."""

from __future__ import annotations

import math

from llmopt.bench.knee import SweepPoint, find_knee


def _sweep(xs, tputs, lats, slo=None):
    slo = slo or [None] * len(xs)
    return [SweepPoint(x=x, throughput=t, latency_ms=la, slo_met=s) for x, t, la, s in zip(xs, tputs, lats, slo,
                                                                                         strict=True)]


SATURATING = _sweep(
    [1, 2, 4, 8, 16, 32],
    [100, 195, 370, 600, 640, 650],
    [100, 105, 110, 130, 260, 520],
)


def test_saturating_curve_knee_at_the_bend():
    # normalized heights above the chord: 0, .16, .47, .84, .60, 0 -> concurrency 8
    k = find_knee(SATURATING)
    assert k is not None and k.method == "kneedle"
    assert k.index == 3 and k.point == SATURATING[3]
    assert k.bend is not None and 0.8 < k.bend < 0.9
    assert k.recommendation == "run with max concurrency 8: 600 tok/s at p99 TTFT 130 ms"


def test_overload_collapse_points_are_ignored():
    # past saturation throughput drops while latency explodes: dominated, so the knee does not move
    pts = SATURATING + _sweep([64], [500], [2000])
    assert find_knee(pts).index == 3


def test_slo_picks_highest_throughput_within_slo():
    pts = _sweep([1, 2, 4, 8], [100, 190, 350, 400], [200, 400, 900, 2500], slo=[True, True, True, False])
    k = find_knee(pts, x_kind="request_rate", latency_label="p99 TTFT")
    assert k.method == "slo" and k.index == 2
    assert k.recommendation.startswith("run at request rate 4 req/s: 350 tok/s at p99 TTFT 900 ms")


def test_slo_never_met():
    pts = _sweep([1, 2], [100, 190], [1200, 3000], slo=[False, False])
    k = find_knee(pts)
    assert k.method == "slo" and k.point is None and k.index is None
    assert "no load level met the SLO" in k.recommendation
    assert "max concurrency 1" in k.recommendation  # names the least-bad level


def test_single_point():
    pts = _sweep([4], [123.4], [250])
    k = find_knee(pts)
    assert k.method == "single_point" and k.index == 0
    assert "only one load level" in k.recommendation


def test_two_points_have_no_curvature():
    k = find_knee(_sweep([1, 2], [100, 180], [100, 150]))
    assert k.method == "too_few_points" and k.index == 1


def test_linear_curve_has_no_knee():
    # throughput and latency both grow linearly: a straight line, never saturated -> highest load
    pts = _sweep([1, 2, 4, 8, 16], [100 * x for x in (1, 2, 4, 8, 16)], [10 * x for x in (1, 2, 4, 8, 16)])
    k = find_knee(pts)
    assert k.method == "linear" and k.index == 4
    assert "try higher load" in k.recommendation


def test_flat_throughput_picks_lowest_latency():
    k = find_knee(_sweep([1, 2, 4, 8], [300, 300, 300, 300], [50, 90, 170, 330]))
    assert k.method == "flat" and k.index == 0


def test_infinite_load_and_missing_latency():
    pts = _sweep([1, 2, math.inf], [100, 150, 160], [100, 200, None])
    k = find_knee(pts, x_kind="request_rate")
    assert k.index == 1 and k.method == "too_few_points"
    k = find_knee(_sweep([math.inf], [100], [100]), x_kind="request_rate")
    assert k.recommendation.startswith("send all requests at once")
    k = find_knee(_sweep([math.inf], [100], [100]))
    assert k.recommendation.startswith("run with unbounded concurrency")


def test_empty_sweep():
    assert find_knee([]) is None
