"""Confidence intervals and paired tests, from scipy.stats, shared by `bench` and `eval`.

A gate on a point estimate fails both ways: at the sizes people use, a 12-question accuracy carries
+-13 points of noise, and a perplexity over a dozen windows has no error bar at all. Both commands
compare two things on the *same* items (rounds of an A/B benchmark, questions and text windows of an
eval), so the statistics here are paired: a round or a window that is hard for both sides cancels out.

- `bootstrap_interval`: scipy's seeded BCa bootstrap of any statistic over paired items (falling back to
  the percentile interval where BCa is degenerate), at Hesterberg's *expanded* level for few items
  (`expanded_level`): resampling n values cannot show more spread than those n values have, so a plain
  95% interval over 8-12 items is too narrow (measured on bench rounds: see llmopt/bench/ab_stats.py).
- Paired proportions (one 0/1 outcome per item for each side, e.g. a question answered right): McNemar's
  exact test (`scipy.stats.binomtest` on the discordant items) and the Agresti-Min interval for the
  difference (Agresti & Min 2005, "Simple improved confidence intervals for comparing matched
  proportions": a Wald interval after adding 1/2 to each cell of the 2x2 table). Unlike a bootstrap or a
  plain Wald interval it does not collapse to [0, 0] when no item differs: 100 identical answers still
  leave +-1.9 points, because 100 items cannot show that the two agree on the next 1,000.
- Power: of that exact test at n items, and the items an *unpaired* comparison of the two accuracies
  (lm-eval's z-test on two independent means) needs for the same power.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_CONFIDENCE = 0.95
N_RESAMPLES = 9999


def expanded_level(confidence: float, n: int) -> float:
    """Hesterberg's expanded bootstrap level for n values: 1 - 2 Phi(-sqrt(n/(n-1)) t_{n-1}(1 - alpha/2))."""
    from scipy.stats import norm, t

    alpha = 1.0 - confidence
    level = 1.0 - 2.0 * norm.cdf(-math.sqrt(n / (n - 1)) * t.ppf(1.0 - alpha / 2.0, n - 1))
    return float(min(level, 1.0 - 1e-6))  # two values: ~1, which scipy refuses; the min/max of the resamples


def bootstrap_interval(data: Sequence[np.ndarray], statistic: Callable[..., np.ndarray], *, paired: bool = True,
                       confidence: float = DEFAULT_CONFIDENCE, seed: int = 0, n_resamples: int = N_RESAMPLES,
                       expand: bool = True) -> tuple[float, float, float] | None:
    """(low, high, level used) of `statistic(*data, axis=-1)` by scipy's seeded BCa bootstrap; None below two
    items or when no finite interval comes out. Data without any spread give the point as its own interval."""
    n = min(len(d) for d in data)
    if n < 2:
        return None
    if all(np.ptp(d) == 0 for d in data):
        point = float(statistic(*data, axis=-1))
        return (point, point, confidence) if math.isfinite(point) else None
    level = expanded_level(confidence, n) if expand else confidence
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # degenerate-data warnings: handled by the percentile fallback
        low, high = _bootstrap(data, statistic, paired, level, seed, n_resamples, "BCa")
        if not (math.isfinite(low) and math.isfinite(high)):
            low, high = _bootstrap(data, statistic, paired, level, seed, n_resamples, "percentile")
    if not (math.isfinite(low) and math.isfinite(high)):
        return None
    return low, high, level


def _bootstrap(data: Sequence[np.ndarray], statistic: Callable[..., np.ndarray], paired: bool, confidence: float,
               seed: int, n_resamples: int, method: str) -> tuple[float, float]:
    from scipy.stats import bootstrap

    res = bootstrap(tuple(data), statistic, paired=paired, vectorized=True, confidence_level=confidence,
                    n_resamples=n_resamples, method=method, rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


# ------------------------------------------------------------------------------ paired proportions


@dataclass(frozen=True)
class PairedCounts:
    """One 0/1 outcome per item on each side. `a_only`: items only side A got right; `b_only`: only B."""

    n: int
    a_only: int
    b_only: int

    @classmethod
    def of(cls, a: Sequence[float], b: Sequence[float]) -> PairedCounts:
        if len(a) != len(b):
            raise ValueError(f"paired outcomes need the same items: {len(a)} against {len(b)}")
        if any(x not in (0, 1) for x in (*a, *b)):
            raise ValueError("paired proportions need 0/1 outcomes")
        return cls(len(a), sum(1 for x, y in zip(a, b, strict=True) if x and not y),
                   sum(1 for x, y in zip(a, b, strict=True) if y and not x))

    @property
    def discordant(self) -> int:
        return self.a_only + self.b_only

    @property
    def difference(self) -> float:
        """P(A right) - P(B right): A's accuracy minus B's."""
        return (self.a_only - self.b_only) / self.n if self.n else float("nan")


def mcnemar_exact_p(c: PairedCounts) -> float:
    """Two-sided exact McNemar p-value: `binomtest` of A-only successes among the discordant items at 1/2."""
    from scipy.stats import binomtest

    if c.discordant == 0:
        return 1.0
    return float(binomtest(c.a_only, c.discordant, 0.5, alternative="two-sided").pvalue)


def paired_difference_interval(c: PairedCounts, confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float]:
    """Agresti-Min interval for P(A right) - P(B right) on the same items (module docstring), within [-1, 1]."""
    from scipy.stats import norm

    return _agresti_min(c.n, c.a_only, c.b_only, float(norm.ppf(1.0 - (1.0 - confidence) / 2.0)))


def _agresti_min(n: float, a_only: float, b_only: float, z: float) -> tuple[float, float]:
    a, b, m = a_only + 0.5, b_only + 0.5, n + 2.0
    diff = (a - b) / m
    sd = math.sqrt(max((a + b) - (a - b) ** 2 / m, 0.0)) / m
    return max(-1.0, diff - z * sd), min(1.0, diff + z * sd)


def items_to_bound(c: PairedCounts, margin: float, confidence: float = DEFAULT_CONFIDENCE,
                   max_items: int = 10_000_000) -> int | None:
    """Items at which the interval's upper bound on A - B would reach `margin` (a fraction), if every rate
    stayed as observed (discordant items in the same proportion); None when the point estimate is not below
    the margin (more items would not help) or it would take more than `max_items`."""
    from scipy.stats import norm

    if c.n == 0 or c.difference >= margin:
        return None
    z = float(norm.ppf(1.0 - (1.0 - confidence) / 2.0))
    ra, rb = c.a_only / c.n, c.b_only / c.n

    def ok(n: int) -> bool:
        return _agresti_min(n, ra * n, rb * n, z)[1] <= margin

    if ok(c.n):
        return c.n
    lo, hi = c.n, c.n
    while not ok(hi):
        lo, hi = hi, hi * 2
        if hi > max_items:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def mcnemar_power(n: int, p_a_only: float, p_b_only: float, alpha: float = 0.05) -> float:
    """Power of the two-sided exact McNemar test at level `alpha` on n items, when an item is A-only right with
    probability `p_a_only` and B-only with `p_b_only` (exact: summed over the number of discordant items)."""
    from scipy.stats import binom

    pd = p_a_only + p_b_only
    if n < 1 or pd <= 0:
        return 0.0
    pi = p_a_only / pd
    k = np.arange(n + 1)
    # the largest c with 2 P(X <= c) <= alpha under X ~ Binomial(k, 1/2): reject when min(X, k - X) <= c
    crit = np.array([_critical(int(m), alpha) for m in k])
    reject = np.where(crit >= 0, binom.cdf(crit, k, pi) + binom.sf(k - crit - 1, k, pi), 0.0)
    # both tails overlap only when crit >= k / 2, which alpha < 1 rules out
    return float(np.sum(binom.pmf(k, n, pd) * reject))


def _critical(k: int, alpha: float) -> int:
    from scipy.stats import binom

    if k == 0:
        return -1
    c = int(binom.ppf(alpha / 2.0, k, 0.5))
    while c >= 0 and 2.0 * binom.cdf(c, k, 0.5) > alpha:
        c -= 1
    return c


def unpaired_items_for_power(p_a: float, p_b: float, power: float, alpha: float = 0.05) -> int | None:
    """Items per side an unpaired two-sided z-test of two independent accuracies (lm-eval's comparison:
    the difference over sqrt(se_a^2 + se_b^2)) needs to reach `power`; None when the accuracies are equal
    or the power is out of (alpha, 1)."""
    from scipy.stats import norm

    d = abs(p_a - p_b)
    if d == 0 or not alpha < power < 1:
        return None
    var = p_a * (1 - p_a) + p_b * (1 - p_b)
    return math.ceil((norm.ppf(1 - alpha / 2) + norm.ppf(power)) ** 2 * var / d ** 2)
