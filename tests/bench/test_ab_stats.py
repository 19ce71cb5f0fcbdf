"""Bootstrap ratio intervals: the numbers are scipy.stats.bootstrap's own on fixed data, pairing matters,
and the edge cases (too few rounds, no spread, missing values) give what the docstring says."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from llmopt.bench.ab_stats import expanded_level, ratio_interval

A = [101.0, 93.5, 110.2, 98.7, 104.9, 90.1, 107.3, 99.8]
B = [96.4, 90.2, 104.8, 95.9, 99.0, 87.3, 101.1, 95.5]


def _scipy(a, b, *, paired, confidence, seed, method="BCa"):
    res = stats.bootstrap((np.array(a), np.array(b)), lambda x, y, axis: np.mean(y, axis=axis) / np.mean(x, axis=axis),
                          paired=paired, vectorized=True, confidence_level=confidence, n_resamples=9999,
                          method=method, rng=np.random.default_rng(seed))
    return res.confidence_interval.low, res.confidence_interval.high


def test_expanded_level_is_hesterbergs():
    for n, conf in ((4, 0.95), (8, 0.95), (12, 0.9), (30, 0.99)):
        t = stats.t.ppf(1 - (1 - conf) / 2, n - 1)
        assert expanded_level(conf, n) == pytest.approx(1 - 2 * stats.norm.cdf(-np.sqrt(n / (n - 1)) * t))
        assert conf < expanded_level(conf, n) < 1
    assert expanded_level(0.95, 1000) == pytest.approx(0.95, abs=1e-3)  # no expansion left with many rounds


@pytest.mark.parametrize("paired", [True, False])
@pytest.mark.parametrize("confidence", [0.9, 0.95])
@pytest.mark.parametrize("expand", [True, False])
def test_interval_is_scipys_bca_interval(paired, confidence, expand):
    est = ratio_interval(A, B, paired=paired, confidence=confidence, seed=7, expand=expand)
    level = expanded_level(confidence, len(A)) if expand else confidence
    low, high = _scipy(A, B, paired=paired, confidence=level, seed=7)
    assert est.level_used == pytest.approx(level) and est.confidence == confidence
    assert est.ratio == pytest.approx(np.mean(B) / np.mean(A))
    assert (est.low, est.high) == pytest.approx((low, high), rel=1e-12)
    assert est.low < est.ratio < est.high and est.rounds == len(A) and est.paired is paired
    # B is ~4% slower in every round: paired, that shows; resampled independently, the rounds' spread hides it
    assert est.contains(1.0) is (not paired)


def test_pairing_cancels_a_drift_shared_by_both_sides():
    """Rounds differ by up to 20% (the machine), B is exactly 3% below A in each: only pairing sees it."""
    a = [100.0, 120.0, 85.0, 110.0, 95.0, 118.0]
    b = [0.97 * x for x in a]
    paired = ratio_interval(a, b, paired=True)
    unpaired = ratio_interval(a, b, paired=False, expand=False)
    assert paired.low == pytest.approx(0.97) and paired.high == pytest.approx(0.97)
    assert unpaired.low < 0.9 and unpaired.high > 1.04  # unpaired, the drift swamps a 3% difference


def test_seed_makes_it_reproducible_and_level_widens_it():
    e1, e2 = ratio_interval(A, B, seed=1), ratio_interval(A, B, seed=1)
    assert (e1.low, e1.high) == (e2.low, e2.high)
    wide = ratio_interval(A, B, seed=1, confidence=0.99)
    assert wide.low < e1.low and wide.high > e1.high
    plain = ratio_interval(A, B, seed=1, expand=False)
    assert plain.low > e1.low and plain.high < e1.high  # the expansion widens few rounds' interval


def test_edge_cases():
    assert ratio_interval([5.0], [6.0]).model_dump(include={"ratio", "low", "high", "rounds"}) == \
        {"ratio": 1.2, "low": None, "high": None, "rounds": 1}  # one round: a point, no interval
    same = ratio_interval([2.0, 2.0, 2.0], [3.0, 3.0, 3.0])
    assert (same.ratio, same.low, same.high) == (1.5, 1.5, 1.5)  # no spread: the point is the interval
    # a round missing on either side is dropped from a paired comparison
    gap = ratio_interval([1.0, None, 2.0, 3.0], [1.0, 5.0, None, 3.0])
    assert gap.rounds == 2 and gap.ratio == 1.0
    assert ratio_interval([0.0, 0.0], [1.0, 2.0]).ratio is None  # A measured zero: no ratio
    assert ratio_interval([], []).describe() == "n/a"
