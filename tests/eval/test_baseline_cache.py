"""`BaselineCache`: evals of several candidates against one baseline (the gate search's trials) measure the
baseline once, and report what separate evals report."""

from __future__ import annotations

import pytest

import llmopt.eval.compare as compare
from llmopt.eval.compare import BaselineCache, run_eval
from llmopt.eval.options import EvalOptions
from llmopt.testing.tiny_model import write_tiny_llama

TEXT = ("The quick brown fox jumps over the lazy dog. A KV cache stores keys and values for every token. "
        "Quantization trades a little quality for memory bandwidth and speed. ") * 10


@pytest.fixture
def built(monkeypatch) -> list[str]:
    """The models run_eval loads, in order (the real build_llm does the loading)."""
    names: list[str] = []
    real = compare.build_llm

    def counting(model, opts):
        names.append(model)
        return real(model, opts)

    monkeypatch.setattr(compare, "build_llm", counting)
    return names


def test_the_baseline_is_measured_once_and_reports_are_unchanged(tiny_llama, tmp_path, built):
    other = write_tiny_llama(tmp_path / "other", seed=1)
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    opts = {"baseline": str(tiny_llama), "ppl_data": data, "seq_len": 64, "gates": ["kl_div<=10"]}
    cache = BaselineCache()
    first = run_eval(EvalOptions(model=str(tiny_llama), **opts), baseline_cache=cache)
    second = run_eval(EvalOptions(model=str(other), **opts), baseline_cache=cache)
    assert built == [str(tiny_llama), str(tiny_llama), str(other)]  # the baseline once, then each candidate
    alone = run_eval(EvalOptions(model=str(other), **opts))
    assert second.text.nll[0].ppl == first.text.nll[0].ppl == alone.text.nll[0].ppl  # the baseline's
    assert second.text.nll[1].ppl == alone.text.nll[1].ppl
    assert second.text.divergence.kl_div == pytest.approx(alone.text.divergence.kl_div, rel=1e-6)
    assert second.text.divergence.kl_div > 0
    assert first.text.divergence.kl_div == pytest.approx(0.0, abs=1e-6)
    assert second.models["baseline"] == alone.models["baseline"]


def test_other_options_measure_the_baseline_again(tiny_llama, tmp_path, built):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    cache = BaselineCache()
    for seq_len in (64, 32):
        run_eval(EvalOptions(model=str(tiny_llama), baseline=str(tiny_llama), ppl_data=data, seq_len=seq_len),
                 baseline_cache=cache)
    assert built == [str(tiny_llama)] * 4
