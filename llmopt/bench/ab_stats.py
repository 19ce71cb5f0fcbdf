"""Ratios between two targets with bootstrap confidence intervals over rounds (scipy.stats.bootstrap).

One run of a benchmark on a shared machine measures the machine as much as the target: round-to-round
spreads of 15% are common. What survives is a ratio taken side by side, so A/B benchmarks repeat the
same work in interleaved rounds and report, per metric, mean(B) / mean(A) over the rounds with a
bootstrap interval: the rounds are resampled with replacement (paired, when A and B ran interleaved in
one invocation, so that a round where the machine was slow for both cancels out), the ratio is
recomputed for each resample, and the interval is scipy's BCa interval of those ratios. Everything is
seeded: the same rounds give the same interval.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, Field

DEFAULT_CONFIDENCE = 0.95
N_RESAMPLES = 9999


class RatioEstimate(BaseModel):
    """mean(B) / mean(A) over rounds, and its bootstrap interval at `confidence` (None: not computable)."""

    ratio: float | None = Field(description="Point estimate: mean of B's rounds / mean of A's rounds.")
    low: float | None = None
    high: float | None = None
    confidence: float = DEFAULT_CONFIDENCE
    rounds: int = Field(0, description="Rounds that had the metric on both sides (pairs when paired).")
    paired: bool = True

    def contains(self, value: float) -> bool | None:
        return None if self.low is None or self.high is None else self.low <= value <= self.high

    def describe(self) -> str:
        if self.ratio is None:
            return "n/a"
        if self.low is None or self.high is None:
            return f"x{self.ratio:.3f} (no interval)"
        return f"x{self.ratio:.3f} [{self.low:.3f}, {self.high:.3f}]"


def _ratio_of_means(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(b, axis=axis) / np.mean(a, axis=axis)


def ratio_interval(a: Sequence[float | None], b: Sequence[float | None], *, paired: bool = True,
                   confidence: float = DEFAULT_CONFIDENCE, seed: int = 0,
                   n_resamples: int = N_RESAMPLES) -> RatioEstimate:
    """mean(b) / mean(a) with scipy's seeded BCa bootstrap interval.

    Paired: `a[i]` and `b[i]` come from round i; a round missing either value is dropped. Unpaired
    (two separate runs): each side is resampled on its own. Fewer than two values on a side, or a zero
    mean for A, gives no interval; rounds that are all identical give the point as its own interval.
    """
    if paired:
        pairs = [(x, y) for x, y in zip(a, b, strict=True) if _ok(x) and _ok(y)]
        xa = np.array([p[0] for p in pairs], dtype=np.float64)
        xb = np.array([p[1] for p in pairs], dtype=np.float64)
        n = len(pairs)
    else:
        xa = np.array([x for x in a if _ok(x)], dtype=np.float64)
        xb = np.array([y for y in b if _ok(y)], dtype=np.float64)
        n = min(len(xa), len(xb))
    if len(xa) == 0 or len(xb) == 0 or xa.mean() == 0:
        return RatioEstimate(ratio=None, confidence=confidence, rounds=n, paired=paired)
    point = float(xb.mean() / xa.mean())
    est = RatioEstimate(ratio=point, confidence=confidence, rounds=n, paired=paired)
    if n < 2:
        return est
    if np.ptp(xa) == 0 and np.ptp(xb) == 0:  # no spread: every resample gives the point itself
        return est.model_copy(update={"low": point, "high": point})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # degenerate-data warnings: handled below by a percentile fallback
        low, high = _bootstrap(xa, xb, paired, confidence, seed, n_resamples, "BCa")
        if not (math.isfinite(low) and math.isfinite(high)):
            low, high = _bootstrap(xa, xb, paired, confidence, seed, n_resamples, "percentile")
    if not (math.isfinite(low) and math.isfinite(high)):
        return est
    return est.model_copy(update={"low": low, "high": high})


def _bootstrap(xa: np.ndarray, xb: np.ndarray, paired: bool, confidence: float, seed: int,
               n_resamples: int, method: str) -> tuple[float, float]:
    from scipy.stats import bootstrap

    res = bootstrap((xa, xb), _ratio_of_means, paired=paired, vectorized=True, confidence_level=confidence,
                    n_resamples=n_resamples, method=method, rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _ok(v: float | None) -> bool:
    return v is not None and math.isfinite(v)
