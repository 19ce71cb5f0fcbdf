"""llmopt.stats against scipy.stats' own answers on fixed data, and the properties the gates rely on."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from llmopt.stats import (
    PairedCounts,
    bootstrap_interval,
    expanded_level,
    items_to_bound,
    mcnemar_exact_p,
    mcnemar_power,
    paired_difference_interval,
    unpaired_items_for_power,
)

RNG = np.random.default_rng(20240601)
# 150 questions: the baseline right on 80%, the candidate loses 9 of them and gains 3 others
BASE = np.array([1] * 120 + [0] * 30)
CAND = BASE.copy()
CAND[:9] = 0
CAND[120:123] = 1


def test_counts_and_mcnemar_match_scipy_binomtest():
    c = PairedCounts.of(BASE.tolist(), CAND.tolist())
    assert (c.n, c.a_only, c.b_only, c.discordant) == (150, 9, 3, 12)
    assert c.difference == pytest.approx(BASE.mean() - CAND.mean())
    assert mcnemar_exact_p(c) == pytest.approx(stats.binomtest(9, 12, 0.5).pvalue, rel=1e-12)
    # the exact two-sided McNemar p is symmetric in the two sides
    assert mcnemar_exact_p(PairedCounts.of(CAND.tolist(), BASE.tolist())) == pytest.approx(mcnemar_exact_p(c))
    assert mcnemar_exact_p(PairedCounts(100, 0, 0)) == 1.0
    with pytest.raises(ValueError):
        PairedCounts.of([1, 0], [1])
    with pytest.raises(ValueError):
        PairedCounts.of([0.5, 1], [1, 1])


def test_bootstrap_interval_is_scipys_bca_at_the_expanded_level():
    x = RNG.normal(3.0, 0.4, 14)
    y = x + RNG.normal(0.1, 0.05, 14)

    def diff(a, b, axis=-1):
        return np.mean(b, axis=axis) - np.mean(a, axis=axis)

    low, high, level = bootstrap_interval((x, y), diff, confidence=0.95, seed=3)
    assert level == pytest.approx(expanded_level(0.95, 14)) and level > 0.95
    ref = stats.bootstrap((x, y), diff, paired=True, vectorized=True, confidence_level=level, n_resamples=9999,
                          method="BCa", rng=np.random.default_rng(3)).confidence_interval
    assert (low, high) == pytest.approx((ref.low, ref.high), rel=1e-12)
    plain = bootstrap_interval((x, y), diff, confidence=0.95, seed=3, expand=False)
    assert plain[2] == 0.95 and high - low > plain[1] - plain[0]  # the expanded interval is wider
    assert bootstrap_interval((np.zeros(5), np.zeros(5)), diff) == (0.0, 0.0, 0.95)  # no spread: the point
    assert bootstrap_interval((x[:1], y[:1]), diff) is None


def test_paired_interval_agrees_with_the_paired_t_interval_at_size():
    """Agresti-Min adds half an item to each cell: with thousands of items it is the paired Wald interval,
    which scipy's paired t-test interval (ttest_rel) matches at that size."""
    a = (RNG.random(4000) < 0.8).astype(int)
    b = np.where(RNG.random(4000) < 0.06, 1 - a, a)
    low, high = paired_difference_interval(PairedCounts.of(a.tolist(), b.tolist()), 0.95)
    ref = stats.ttest_rel(a, b).confidence_interval(0.95)
    assert low == pytest.approx(ref.low, abs=2e-4) and high == pytest.approx(ref.high, abs=2e-4)


def test_paired_interval_does_not_collapse_without_discordant_items():
    """100 identical answers still leave an interval (a bootstrap or Wald interval would be [0, 0]), and it
    narrows as items are added; a wider confidence is a wider interval."""
    w100 = paired_difference_interval(PairedCounts(100, 0, 0))
    w400 = paired_difference_interval(PairedCounts(400, 0, 0))
    assert w100[0] == pytest.approx(-w100[1]) and 0.015 < w100[1] < 0.025
    assert 0 < w400[1] < w100[1] / 3
    c = PairedCounts.of(BASE.tolist(), CAND.tolist())
    l95, h95 = paired_difference_interval(c, 0.95)
    l99, h99 = paired_difference_interval(c, 0.99)
    assert l99 < l95 < c.difference < h95 < h99


def test_items_to_bound_is_the_first_size_that_meets_the_margin():
    c = PairedCounts.of(BASE.tolist(), CAND.tolist())  # drop 4 points, 8% discordant
    assert items_to_bound(c, 0.03) is None  # the point estimate is past the margin: no size helps
    n = items_to_bound(c, 0.06)
    assert n is not None and n > c.n

    def upper(m):
        scaled = PairedCounts(m, round(c.a_only * m / c.n), round(c.b_only * m / c.n))
        return paired_difference_interval(scaled)[1]

    assert upper(n) <= 0.06 + 1e-3 and upper(n - n // 10) > 0.06
    assert items_to_bound(PairedCounts(100, 0, 0), 0.05) == 100  # already decided


def test_mcnemar_power_matches_a_simulation_with_scipy_binomtest():
    rng = np.random.default_rng(5)
    n, pa, pb = 120, 0.08, 0.02
    reject = 0
    sims = 1500
    for _ in range(sims):
        cells = rng.multinomial(n, [pa, pb, 1 - pa - pb])
        d = cells[0] + cells[1]
        reject += d > 0 and stats.binomtest(int(cells[0]), int(d), 0.5).pvalue <= 0.05
    assert mcnemar_power(n, pa, pb) == pytest.approx(reject / sims, abs=0.04)
    assert mcnemar_power(n, 0.05, 0.05) <= 0.05  # no difference: at most the level
    assert mcnemar_power(4 * n, pa, pb) > mcnemar_power(n, pa, pb)


def test_unpaired_items_reach_the_power_of_the_z_test():
    pa, pb, power = 0.8, 0.74, 0.8
    n = unpaired_items_for_power(pa, pb, power)

    def z_power(m):  # lm-eval's comparison: the difference over sqrt(se_a^2 + se_b^2), two-sided
        se = np.sqrt((pa * (1 - pa) + pb * (1 - pb)) / m)
        return stats.norm.cdf(abs(pa - pb) / se - stats.norm.ppf(0.975))

    assert z_power(n) >= power > z_power(n - 2)
    assert unpaired_items_for_power(0.8, 0.8, 0.8) is None
    assert unpaired_items_for_power(0.8, 0.7, 0.01) is None
