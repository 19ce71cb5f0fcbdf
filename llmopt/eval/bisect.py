"""Bisect a quality drop: which optimization, and which layers, account for it.

Given a baseline and a candidate that differs from it by some optimizations (its weights — e.g.
quantized via a `quantization_config` —, an INT8 KV cache, a lower-precision dtype), we:

1. measure the candidate as is and with each optimization turned off, one at a time (weights: the
   baseline's weights under the candidate's other settings; KV cache: `auto`; dtype: the baseline's),
   so the report says how much of the KL divergence each one is responsible for;
2. when the weights differ, restore one decoder layer at a time from the baseline into the candidate
   (the module is swapped in the running engine, so a quantized layer is replaced by the float one)
   and measure again: the layers whose restoration removes the most divergence are the sensitive
   ones;
3. find the fewest most-sensitive layers whose restoration makes the text gates (`kl_div`,
   `top1_agreement`, `ppl_increase_pct`) pass (binary search over k, ~log2(layers) measurements), and
   suggest the matching `llmopt quantize --ignore` regexes.

All measurements use the same first tokens of the eval text (tokens x vocabulary up to 2^28, e.g. 5,461
tokens of SmolLM2), the same windows as the perplexity run, and the baseline's top-k log-probs recorded
once (`divergence.BaselineTopK`), so they are comparable with each other. Bisect swaps layers between the
two models, so unlike the rest of `eval` it holds both in memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmopt.engine.llm import LLM
from llmopt.engine.llm_engine import LLMEngine
from llmopt.eval.divergence import BaselineTopK
from llmopt.eval.engines import EngineOptions, build_llm
from llmopt.eval.perplexity import score_text
from llmopt.gates import Gate
from llmopt.io import atomic_write

# tokens x vocabulary of the bisect text: bounds the cost of each of its ~layers + log2(layers) measurements
_TOKEN_VOCAB_BUDGET = 1 << 28
TEXT_METRICS = ("kl_div", "top1_agreement", "ppl_increase_pct")


@dataclass
class Measurement:
    label: str
    kl_div: float
    top1_agreement: float
    ppl: float
    ppl_increase_pct: float

    def value(self, metric: str) -> float:
        return float(getattr(self, metric))

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "kl_div": self.kl_div, "top1_agreement": self.top1_agreement,
                "ppl": self.ppl, "ppl_increase_pct": self.ppl_increase_pct}


@dataclass
class BisectResult:
    tokens: int
    candidate: Measurement
    factors: list[dict[str, Any]] = field(default_factory=list)  # one optimization off at a time
    layers: list[dict[str, Any]] = field(default_factory=list)  # one layer restored at a time
    suggestion: dict[str, Any] | None = None
    plot: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "candidate": self.candidate.to_json(), "factors": self.factors,
                "layers": self.layers, "suggestion": self.suggestion, "plot": self.plot}


class _Reference:
    """The baseline's top-k log-probs on the bisect tokens, recorded once and compared against by every
    measurement (`divergence.BaselineTopK`)."""

    def __init__(self, engine: LLMEngine, ids: list[int], seq_len: int):
        self.ids, self.seq_len = ids, seq_len
        self.topk = BaselineTopK()
        self.nll = score_text(engine, ids, seq_len, record=self.topk).nll[0]

    def measure(self, engine: LLMEngine, label: str) -> Measurement:
        s = score_text(engine, self.ids, self.seq_len, compare_to=self.topk)
        div, nll = s.divergence, s.nll[0]
        return Measurement(label, div.kl_div, div.top1_agreement, nll.ppl, 100.0 * (nll.ppl / self.nll.ppl - 1.0))


@contextlib.contextmanager
def restored_layers(candidate: LLMEngine, baseline: LLMEngine, layers: list[int]) -> Iterator[None]:
    """Temporarily run `layers` of the candidate with the baseline's modules (weights and all)."""
    saved = {i: candidate.model.layers[i] for i in layers}
    try:
        for i in layers:
            candidate.model.layers[i] = baseline.model.layers[i]
        yield
    finally:
        for i, module in saved.items():
            candidate.model.layers[i] = module


def _weights_differ(candidate: LLMEngine, baseline: LLMEngine) -> bool:
    if candidate.resolved.quantization_config is not None:
        return True
    a = candidate.model.state_dict()  # not named_parameters: packed CPU weights are no parameters
    b = baseline.model.state_dict()
    if a.keys() != b.keys():
        return True
    return any(not torch.equal(a[k].float(), b[k].to(a[k].device).float()) for k in a)


def _meets(m: Measurement, gates: list[Gate]) -> bool:
    return all(g.check(m.value(g.metric)) for g in gates)


def _fewest_layers(ref: _Reference, candidate: LLMEngine, baseline: LLMEngine, order: list[int],
                   gates: list[Gate]) -> tuple[int, Measurement]:
    """Smallest k such that restoring the k most sensitive layers meets the gates (binary search:
    restoring more layers only brings the candidate closer to the baseline). If even all of them do not
    suffice (another optimization, e.g. the KV cache, is to blame), returns all with that measurement."""

    def measure(k: int) -> Measurement:
        with restored_layers(candidate, baseline, order[:k]):
            return ref.measure(candidate, f"{k} most sensitive layers restored")

    hi, best = len(order), measure(len(order))
    if not _meets(best, gates):
        return hi, best
    lo = 0  # restoring 0 layers fails (checked by the caller)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        m = measure(mid)
        if _meets(m, gates):
            hi, best = mid, m
        else:
            lo = mid
    return hi, best


def ignore_regex(layer: int) -> str:
    """The `llmopt quantize --ignore` regex (searched in HF module names) that keeps a layer in float."""
    return rf"model\.layers\.{layer}\."


def run_bisect(baseline: LLM, candidate: LLM, candidate_model: str | None, baseline_model: str,
               cand_opts: EngineOptions, base_opts: EngineOptions, token_ids: list[int], seq_len: int,
               gates: list[Gate], plot: Path | None = None,
               progress: Callable[[str, int, int], None] | None = None) -> BisectResult:
    vocab = candidate.engine.spec.vocab_size
    max_tokens = max(seq_len, (_TOKEN_VOCAB_BUDGET // vocab) // seq_len * seq_len)
    ids = token_ids[:max_tokens]
    ref = _Reference(baseline.engine, ids, seq_len)
    cand = ref.measure(candidate.engine, "candidate")
    result = BisectResult(ref.nll.tokens, cand)
    text_gates = [g for g in gates if g.metric in TEXT_METRICS]

    def record(label: str, what: str, m: Measurement) -> None:
        removed = cand.kl_div - m.kl_div
        share = removed / cand.kl_div if cand.kl_div > 0 else 0.0
        result.factors.append({"factor": label, "what": what, **m.to_json(), "kl_removed": removed,
                               "share_of_kl": share})

    # 1. one optimization off at a time
    weights_differ = _weights_differ(candidate.engine, baseline.engine)
    steps: list[tuple[str, str, Callable[[], LLM]]] = []
    if weights_differ:
        q = candidate.engine.resolved.quantization_config
        what = f"weights ({q.get('quant_method')})" if q else "weights (differ from the baseline's)"
        steps.append(("weights", what, lambda: build_llm(baseline_model, cand_opts)))
    if cand_opts.kv_cache_dtype != base_opts.kv_cache_dtype:
        steps.append(("kv_cache", f"KV cache {cand_opts.kv_cache_dtype}",
                      lambda: build_llm(candidate_model, cand_opts.model_copy(update={"kv_cache_dtype": "auto"}))))
    if candidate.engine.dtype != baseline.engine.dtype:
        steps.append(("dtype", f"dtype {str(candidate.engine.dtype).removeprefix('torch.')}",
                      lambda: build_llm(candidate_model, cand_opts.model_copy(update={"dtype": base_opts.dtype}))))
    for n, (label, what, make) in enumerate(steps):
        if progress:
            progress("bisect: factors", n, len(steps))
        llm = make()
        record(label, what, ref.measure(llm.engine, f"without {label}"))
        del llm
    # 2. per-layer sensitivity of the weights, restoring one decoder layer at a time
    if weights_differ and len(candidate.engine.model.layers) == len(baseline.engine.model.layers):
        n_layers = len(candidate.engine.model.layers)
        for i in range(n_layers):
            if progress:
                progress("bisect: layers", i, n_layers)
            with restored_layers(candidate.engine, baseline.engine, [i]):
                m = ref.measure(candidate.engine, f"layer {i} restored")
            result.layers.append({"layer": i, **m.to_json(), "kl_removed": cand.kl_div - m.kl_div})
        # 3. restore the most sensitive layers until the text gates pass
        if text_gates and not _meets(cand, text_gates):
            order = [r["layer"] for r in sorted(result.layers, key=lambda r: -r["kl_removed"])]
            k, after = _fewest_layers(ref, candidate.engine, baseline.engine, order, text_gates)
            chosen = sorted(order[:k])
            result.suggestion = {"layers": chosen, "ignore": [ignore_regex(i) for i in chosen],
                                 "meets_gates": _meets(after, text_gates), "after": after.to_json(),
                                 "gates": [g.expression for g in text_gates]}
    if plot is not None and result.layers:
        result.plot = str(plot_layers(result, plot))
    return result


def plot_layers(result: BisectResult, path: Path) -> Path:
    """Bar chart of the KL divergence removed by restoring each layer (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [r["layer"] for r in result.layers]
    removed = [r["kl_removed"] for r in result.layers]
    chosen = set((result.suggestion or {}).get("layers", []))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * len(layers) + 2), 3.6))
    ax.bar(layers, removed, color=["#d62728" if i in chosen else "#1f77b4" for i in layers])
    ax.axhline(result.candidate.kl_div, color="gray", linestyle="--", linewidth=1,
               label=f"candidate KL {result.candidate.kl_div:.4g}")
    ax.set_xticks(layers if len(layers) <= 40 else layers[::2])
    ax.set_xlabel("decoder layer restored from the baseline")
    ax.set_ylabel("KL divergence removed (nats/token)")
    ax.set_title("Per-layer sensitivity" + (" (red: suggested --ignore)" if chosen else ""))
    ax.legend(loc="upper right")
    fig.tight_layout()
    path = path.expanduser()
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)
    return path

