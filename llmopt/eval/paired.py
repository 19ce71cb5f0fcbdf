"""Paired statistics of a comparison: intervals and tests on what baseline and candidate did with the same items.

Both models answer the same task documents and score the same text windows, so the comparison is paired:
- a task drop (`TASK.acc_drop`, points) gets the Agresti-Min interval and McNemar's exact p-value from the
  items only one of the two got right (`llmopt.stats`); an item both get right or both get wrong says
  nothing about the difference, which is why a paired test needs far fewer items than comparing two
  accuracies with their separate standard errors;
- `ppl_increase_pct`, `kl_div` and `top1_agreement` get scipy's seeded BCa bootstrap over windows, resampling
  whole windows (the candidate's and the baseline's NLL of a window together), token-weighted as the
  point estimates are, at the expanded level for few windows.
When an interval cannot decide a gate, `undecided_note` says what the data can rule out and about how many
items (or windows) would decide it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from llmopt.eval.perplexity import TextScore
from llmopt.eval.runner import TaskResult
from llmopt.gates import ConfidenceGate
from llmopt.stats import (
    DEFAULT_CONFIDENCE,
    PairedCounts,
    bootstrap_interval,
    items_to_bound,
    mcnemar_exact_p,
    paired_difference_interval,
)

WINDOW_METRICS = ("ppl_increase_pct", "kl_div", "top1_agreement")


@dataclass
class PairedEstimate:
    """A comparison metric's point estimate and interval over `n` paired items (task documents or windows)."""

    point: float
    low: float | None
    high: float | None
    confidence: float
    n: int
    unit: str  # "items" or "windows"
    method: str
    p_value: float | None = None  # McNemar's exact test (task drops)
    counts: PairedCounts | None = None  # task drops: items only the baseline / only the candidate got right
    seq_len: int | None = None  # windows: tokens per window, to say how much text would decide a gate

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"point": self.point, "low": self.low, "high": self.high,
                               "confidence": self.confidence, "n": self.n, "unit": self.unit, "method": self.method}
        if self.counts is not None:
            out.update({"p_value": self.p_value, "baseline_only": self.counts.a_only,
                        "candidate_only": self.counts.b_only})
        return out

    def describe(self) -> str:
        if self.low is None or self.high is None:
            return "-"
        return f"[{self.low:.4g}, {self.high:.4g}]"


def task_drop(base: TaskResult, cand: TaskResult, metric: str,
              confidence: float = DEFAULT_CONFIDENCE) -> PairedEstimate | None:
    """100 * (baseline - candidate) with its paired interval and McNemar p; None without paired 0/1 items."""
    a = [s.get(metric) for s in base.samples]
    b = [s.get(metric) for s in cand.samples]
    if not a or len(a) != len(b) or any(x not in (0, 1) for x in a + b):
        return None
    counts = PairedCounts.of(a, b)  # type: ignore[arg-type]
    low, high = paired_difference_interval(counts, confidence)
    return PairedEstimate(100.0 * counts.difference, 100.0 * low, 100.0 * high, confidence, counts.n, "items",
                          "Agresti-Min paired interval", mcnemar_exact_p(counts), counts)


def worst_drop(estimates: list[PairedEstimate]) -> PairedEstimate | None:
    """The bare `acc_drop` (the largest over tasks): the bounds of the worst task on each side, so a gate on
    it passes only when every task's interval does."""
    if not estimates:
        return None
    if len(estimates) == 1:
        return estimates[0]
    worst = max(estimates, key=lambda e: e.point)
    lows = [e.low for e in estimates]
    highs = [e.high for e in estimates]
    return PairedEstimate(worst.point, None if None in lows else max(lows),  # type: ignore[type-var]
                          None if None in highs else max(highs), worst.confidence,  # type: ignore[type-var]
                          min(e.n for e in estimates), "items", "worst task's bounds")


def _ppl_increase(nb: np.ndarray, nc: np.ndarray, tok: np.ndarray, axis: int = -1) -> np.ndarray:
    t = tok.sum(axis=axis)
    return 100.0 * np.expm1((nc * tok).sum(axis=axis) / t - (nb * tok).sum(axis=axis) / t)


def _ratio_of_sums(x: np.ndarray, tok: np.ndarray, axis: int = -1) -> np.ndarray:
    return x.sum(axis=axis) / tok.sum(axis=axis)


def window_estimate(text: TextScore, metric: str, confidence: float = DEFAULT_CONFIDENCE,
                    seed: int = 0) -> PairedEstimate | None:
    """`ppl_increase_pct`, `kl_div` or `top1_agreement` with a bootstrap interval over windows."""
    div = text.divergence
    tok = np.asarray(text.window_tokens, dtype=np.float64)
    if len(text.per_window_nll) < 2 or not len(tok):
        return None
    if metric == "ppl_increase_pct":
        data = (np.asarray(text.per_window_nll[0]), np.asarray(text.per_window_nll[-1]), tok)
        stat = _ppl_increase
    elif metric in ("kl_div", "top1_agreement") and div is not None and len(div.window_tokens) == len(tok):
        x = div.window_kl if metric == "kl_div" else div.window_matches
        data = (np.asarray(x, dtype=np.float64), tok)
        stat = _ratio_of_sums
    else:
        return None
    point = float(stat(*data))
    found = bootstrap_interval(data, stat, paired=True, confidence=confidence, seed=seed)
    low, high, level = found if found is not None else (None, None, confidence)
    method = f"BCa bootstrap over windows (seeded; computed at the expanded level {level:.4f})" \
        if found is not None else "too few windows for an interval"
    return PairedEstimate(point, low, high, confidence, len(tok), "windows", method,
                          seq_len=int(text.protocol.get("seq_len", 0)) or None)


def undecided_note(est: PairedEstimate, cg: ConfidenceGate) -> str | None:
    """For a gate its interval could not decide ("not shown"): what these items rule out, and about how many
    would decide it if the rates stayed as observed; None when the gate passed or failed outright."""
    g = cg.gate
    if est.low is None or est.high is None:
        return f"{est.n} {est.unit} give no interval"
    bound = est.high if cg.bound == "high" else est.low
    if g.check(bound):
        return None
    what = {"ppl_increase_pct": "increases above {:.3g}%", "kl_div": "KL above {:.3g}",
            "top1_agreement": "agreement below {:.3g}"}.get(g.metric.rsplit(".", 1)[-1],
                                                            "drops above {:.3g} points")
    told = f"with {est.n} {est.unit} this gate can rule out {what.format(bound)}"
    if not g.check(est.point):
        return f"{told}; the point estimate {est.point:.4g} is past {g.threshold:g}, so more would not make it pass"
    if est.counts is not None and cg.bound == "high":
        need = items_to_bound(est.counts, g.threshold / 100.0, est.confidence)
    elif g.threshold != est.point:  # an interval narrows as 1/sqrt(items or windows)
        half = (bound - est.point) / (g.threshold - est.point)
        need = math.ceil(est.n * half * half)
    else:
        need = None  # the point sits on the threshold: no number of items decides it
    if need is None:
        return told
    extra = f" ({need * est.seq_len:,} tokens)" if est.seq_len and est.unit == "windows" else ""
    return f"{told}; about {need:,} {est.unit}{extra} would decide it at the observed rates"
