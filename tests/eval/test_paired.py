"""Paired statistics of a comparison (llmopt/eval/paired.py) on fixed per-item results, against scipy."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from llmopt.eval.divergence import DivergenceStats
from llmopt.eval.paired import task_drop, undecided_note, window_estimate, worst_drop
from llmopt.eval.perplexity import NllStats, TextScore
from llmopt.eval.runner import TaskResult
from llmopt.gates import parse_confidence_gate
from llmopt.stats import expanded_level


def _result(correct: list[int]) -> TaskResult:
    return TaskResult("t", "multiple_choice", {}, [{"acc": float(x)} for x in correct])


def test_task_drop_is_paired():
    base = [1] * 80 + [0] * 20
    cand = [0] * 6 + [1] * 74 + [1] * 2 + [0] * 18  # loses 6, gains 2
    est = task_drop(_result(base), _result(cand), "acc")
    assert est is not None and est.point == pytest.approx(4.0) and est.n == 100 and est.unit == "items"
    assert est.p_value == pytest.approx(stats.binomtest(6, 8, 0.5).pvalue)
    assert est.low < 4.0 < est.high
    assert est.to_json()["baseline_only"] == 6 and est.to_json()["candidate_only"] == 2
    # not paired: different item counts, or a metric that is not 0/1 per item
    assert task_drop(_result(base), _result(cand[:50]), "acc") is None
    odd = TaskResult("t", "multiple_choice", {}, [{"acc": 0.5}] * 100)
    assert task_drop(_result(base), odd, "acc") is None


def test_worst_drop_takes_the_worst_bound_on_each_side():
    a = task_drop(_result([1] * 50), _result([1] * 48 + [0] * 2), "acc")
    b = task_drop(_result([1] * 50), _result([1] * 50), "acc")
    w = worst_drop([a, b])
    assert w.point == a.point and w.low == max(a.low, b.low) and w.high == max(a.high, b.high)


def _score(nb: list[float], nc: list[float], tok: list[int], kl: list[float]) -> TextScore:
    div = DivergenceStats()
    for k, t in zip(kl, tok, strict=True):
        div.add(k * t, t - 1, t)
        div.close_window()
    s = TextScore({"seq_len": 512}, [NllStats(), NllStats()], div, per_window_nll=[nb, nc], window_tokens=tok)
    return s


def test_window_intervals_are_scipys_bootstrap_over_windows():
    rng = np.random.default_rng(11)
    nb = rng.normal(2.5, 0.3, 12)
    nc = nb + rng.normal(0.05, 0.02, 12)
    tok = [511] * 11 + [200]
    kl = list(rng.gamma(2.0, 0.01, 12))
    text = _score(list(nb), list(nc), tok, kl)
    est = window_estimate(text, "ppl_increase_pct", 0.95)
    t = np.array(tok, dtype=float)
    point = 100 * np.expm1((nc * t).sum() / t.sum() - (nb * t).sum() / t.sum())
    assert est.point == pytest.approx(point) and est.unit == "windows" and est.n == 12

    def ppl(a, b, w, axis=-1):
        s = w.sum(axis=axis)
        return 100 * np.expm1((b * w).sum(axis=axis) / s - (a * w).sum(axis=axis) / s)

    ref = stats.bootstrap((nb, nc, t), ppl, paired=True, vectorized=True,
                          confidence_level=expanded_level(0.95, 12), n_resamples=9999, method="BCa",
                          rng=np.random.default_rng(0)).confidence_interval
    assert (est.low, est.high) == pytest.approx((ref.low, ref.high), rel=1e-9)
    kl_est = window_estimate(text, "kl_div")
    assert kl_est.point == pytest.approx(sum(k * n for k, n in zip(kl, tok, strict=True)) / sum(tok))
    assert kl_est.low < kl_est.point < kl_est.high
    top1 = window_estimate(text, "top1_agreement")
    assert top1.point == pytest.approx(1 - 12 / sum(tok))
    assert window_estimate(text, "ppl") is None


def test_divergence_keeps_per_window_sums():
    d = DivergenceStats()
    d.add(1.0, 3, 4)
    d.add(0.5, 1, 2)
    d.close_window()
    d.add(2.0, 0, 5)
    d.close_window()
    assert d.window_kl == [1.5, 2.0] and d.window_matches == [4, 0] and d.window_tokens == [6, 5]
    assert d.kl_div == pytest.approx(3.5 / 11)


def test_undecided_note_says_what_would_decide_it():
    base = [1] * 80 + [0] * 20
    cand = [0] * 3 + [1] * 77 + [1] * 2 + [0] * 18  # drop 1 point, 5 discordant
    est = task_drop(_result(base), _result(cand), "acc")
    note = undecided_note(est, parse_confidence_gate("acc_drop<=3@95"))
    assert note.startswith(f"with 100 items this gate can rule out drops above {est.high:.3g} points; about ")
    assert note.endswith("items would decide it at the observed rates")
    need = int(note.split("about ")[1].split(" ")[0].replace(",", ""))
    assert need > 100
    assert undecided_note(est, parse_confidence_gate("acc_drop<=20@95")) is None  # passes
    past = undecided_note(est, parse_confidence_gate("acc_drop<=0.5@95"))
    assert "the point estimate 1 is past 0.5" in past
    rng = np.random.default_rng(2)
    nb = rng.normal(2.5, 0.3, 8)
    w = window_estimate(_score(list(nb), list(nb + rng.normal(0.01, 0.02, 8)), [511] * 8, [0.01] * 8),
                        "ppl_increase_pct")
    wn = undecided_note(w, parse_confidence_gate(f"ppl_increase_pct<={w.point + (w.high - w.point) / 2:.4f}@95"))
    assert wn.startswith("with 8 windows this gate can rule out increases above") and "tokens) would decide" in wn


def test_undecided_note_with_the_point_on_the_threshold():
    est = task_drop(_result([1] * 100), _result([0] * 2 + [1] * 98), "acc")  # drop exactly 2 points
    note = undecided_note(est, parse_confidence_gate("acc_drop<=2@95"))
    assert note.startswith("with 100 items this gate can rule out drops above") and "would decide" not in note
