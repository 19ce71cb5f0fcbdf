"""Evaluate a candidate (optionally against a baseline) and check quality gates.

Everything that can be wrong with the input (data files, task YAMLs, templates, gate expressions,
gate metrics that this run would not measure) is checked *before* any model is loaded, so a typo
costs a second, not a perplexity run. Then the models run one after the other, so an 8B baseline and
its candidate need the memory of one: the baseline scores the eval text (keeping its top-k log-probs per
scored token) and runs the tasks, is freed, and the candidate does the same, measuring KL(baseline ||
candidate) and top-1 agreement against what the baseline kept (`divergence.BaselineTopK`). Only
`--bisect`, which swaps layers between the two, loads both.

Metric names (what `--gate` accepts) are listed in `metric_names`; see docs/EVAL.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmopt.devices import free_memory, resolve_device
from llmopt.engine.llm import LLM
from llmopt.errors import LlmoptError
from llmopt.eval.bisect import BisectResult, run_bisect
from llmopt.eval.divergence import BaselineTopK
from llmopt.eval.engines import build_llm, float32_notice, weight_bytes
from llmopt.eval.metrics import is_fraction, mean_stderr
from llmopt.eval.options import EvalOptions
from llmopt.eval.paired import (
    WINDOW_METRICS,
    PairedEstimate,
    task_drop,
    undecided_note,
    window_estimate,
    worst_drop,
)
from llmopt.eval.perplexity import TextScore, compare_scores, default_batch_tokens, score_text
from llmopt.eval.runner import TaskResult, evaluate_task
from llmopt.eval.tasks import Task, load_task
from llmopt.eval.textdata import load_text
from llmopt.gates import (
    ConfidenceGate,
    GateResult,
    IntervalGateResult,
    check_gates,
    check_interval_gate,
    parse_confidence_gates,
)
from llmopt.stats import DEFAULT_CONFIDENCE

PPL_METRICS = ("ppl", "nll")
COMPARE_PPL_METRICS = ("ppl_increase_pct", "kl_div", "top1_agreement")


@dataclass
class MetricRow:
    """One line of the comparison: values, candidate - baseline, its standard error, gate outcome."""

    name: str
    candidate: float | None
    baseline: float | None = None
    delta: float | None = None
    stderr: float | None = None
    passed: bool | None = None  # None: no gate on this metric
    gates: list[str] = field(default_factory=list)
    interval: PairedEstimate | None = None  # paired 95% interval (comparison metrics; paired.py)
    verdict: str | None = None  # PASS, NOT SHOWN (a confidence gate its interval cannot decide) or FAIL

    def to_json(self) -> dict[str, Any]:
        out = {"baseline": _num(self.baseline), "candidate": _num(self.candidate), "delta": _num(self.delta),
               "stderr": _num(self.stderr), "pass": self.passed, "gates": self.gates}
        if self.interval is not None:
            out["interval"] = self.interval.to_json()
        return out


def _num(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


@dataclass
class EvalReport:
    options: EvalOptions
    models: dict[str, dict[str, Any]]
    text: TextScore | None
    tasks: dict[str, dict[str, TaskResult]]  # task -> {"candidate": ..., "baseline": ...}
    rows: dict[str, MetricRow]
    gates: list[GateResult]
    seconds: float
    bisect: BisectResult | None = None

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    def to_json(self) -> dict[str, Any]:
        ppl: dict[str, Any] | None = None
        if self.text is not None:
            ppl = {"protocol": self.text.protocol, "seconds": round(self.text.seconds, 3),
                   "candidate": {"ppl": self.text.nll[-1].ppl, "nll": self.text.nll[-1].nll,
                                 "tokens": self.text.nll[-1].tokens}}
            if len(self.text.nll) > 1:
                ppl["baseline"] = {"ppl": self.text.nll[0].ppl, "nll": self.text.nll[0].nll,
                                   "tokens": self.text.nll[0].tokens}
                d = self.text.divergence
                ppl["kl_div"], ppl["top1_agreement"] = d.kl_div, d.top1_agreement
        return {
            "models": self.models,
            "perplexity": ppl,
            "tasks": {t: {role: r.to_json() for role, r in rs.items()} for t, rs in self.tasks.items()},
            "metrics": {k: r.to_json() for k, r in self.rows.items()},
            "gates": [_gate_json(g) for g in self.gates],
            "bisect": self.bisect.to_json() if self.bisect else None,
            "passed": self.passed,
            "seconds": round(self.seconds, 3),
        }


def _gate_json(g: GateResult) -> dict[str, Any]:
    out: dict[str, Any] = {"gate": g.gate.expression, "metric": g.gate.metric, "value": _num(g.value),
                           "pass": g.passed}
    if isinstance(g, IntervalGateResult):  # `value` is the bound the gate read
        out.update({"gate": g.expression, "confidence": g.confidence, "point": _num(g.point), "low": _num(g.low),
                    "high": _num(g.high), "verdict": g.verdict, "note": g.note})
    return out


def metric_names(opts: EvalOptions, tasks: list[Task]) -> list[str]:
    """Every metric this run will measure, i.e. every name a gate may use."""
    names: list[str] = []
    compare = opts.baseline is not None
    if opts.ppl_data is not None:
        names += PPL_METRICS
        if compare:
            names += COMPARE_PPL_METRICS
    counts: dict[str, int] = {}
    for t in tasks:
        for m in t.metrics:
            names.append(f"{t.name}.{m.metric}")
            counts[m.metric] = counts.get(m.metric, 0) + 1
            if compare:
                names.append(f"{t.name}.{m.metric}_drop")
    names += [m for m, c in counts.items() if c == 1]  # a bare name is fine while it is unambiguous
    if compare:
        names += [f"{m}_drop" for m in counts]
    return names


def _aliases(tasks: list[Task]) -> dict[str, str]:
    """Bare task-metric names (`acc`) that name exactly one task's metric (`kb_mc.acc`)."""
    found: dict[str, list[str]] = {}
    for t in tasks:
        for m in t.metrics:
            found.setdefault(m.metric, []).append(f"{t.name}.{m.metric}")
    return {m: names[0] for m, names in found.items() if len(names) == 1}


def interval_metric_names(opts: EvalOptions, tasks: list[Task]) -> list[str]:
    """The metrics that get a paired interval, i.e. those a confidence gate (`@95`) may use: comparisons."""
    if opts.baseline is None:
        return []
    names = [n for n in metric_names(opts, tasks) if n.endswith("_drop")]
    return (list(WINDOW_METRICS) if opts.ppl_data is not None else []) + names


def _validate_gates(gates: list[ConfidenceGate], names: list[str], interval_names: list[str]) -> None:
    for cg in gates:
        g = cg.gate
        if g.metric not in names:
            raise LlmoptError(f"gate {cg.expression!r}: this run does not measure {g.metric!r} "
                              f"(available: {', '.join(names) or 'none'})")
        if is_fraction(g.metric) and not 0 <= g.threshold <= 1:
            drops = "" if g.metric.endswith("top1_agreement") else f"; its drop, {g.metric}_drop, is in points"
            raise LlmoptError(f"gate {cg.expression!r}: {g.metric!r} is a fraction of 1 (write {g.metric}{g.op}"
                              f"{g.threshold / 100:g} for {g.threshold:g}%){drops}")
        if cg.confidence is not None and g.metric not in interval_names:
            raise LlmoptError(f"gate {cg.expression!r}: {g.metric!r} has no interval; a confidence (@) applies to "
                              f"comparisons with --baseline ({', '.join(interval_names) or 'none in this run'})")


def _check_lmeval_models(models: list[str | None]) -> None:
    """lm-eval runs transformers models: refuse quantized checkpoints before anything is loaded."""
    from llmopt.models.resolve import resolve_model

    for m in models:
        q = resolve_model(m).quantization_config
        if q is not None:
            raise LlmoptError(f"--harness lm-eval cannot run {m} (quantized with {q.get('quant_method')!r}); "
                              "use --harness llmopt")


def _paired_stderr(base: TaskResult, cand: TaskResult, metric: str) -> float | None:
    a = [s.get(metric) for s in base.samples]
    b = [s.get(metric) for s in cand.samples]
    if len(a) != len(b) or any(x is None for x in a + b):
        return None
    return 100.0 * mean_stderr([float(x) - float(y) for x, y in zip(a, b, strict=True)])


def _build_rows(opts: EvalOptions, text: TextScore | None, tasks: dict[str, dict[str, TaskResult]],
                task_list: list[Task]) -> dict[str, MetricRow]:
    rows: dict[str, MetricRow] = {}
    compare = opts.baseline is not None
    if text is not None:
        c = text.nll[-1]
        b = text.nll[0] if compare else None
        rows["ppl"] = MetricRow("ppl", c.ppl, b.ppl if b else None, (c.ppl - b.ppl) if b else None)
        rows["nll"] = MetricRow("nll", c.nll, b.nll if b else None, (c.nll - b.nll) if b else None)
        if compare and b is not None and text.divergence is not None:
            rows["ppl_increase_pct"] = MetricRow("ppl_increase_pct", 100.0 * (c.ppl / b.ppl - 1.0))
            rows["kl_div"] = MetricRow("kl_div", text.divergence.kl_div)
            rows["top1_agreement"] = MetricRow("top1_agreement", text.divergence.top1_agreement)
            for name in WINDOW_METRICS:
                rows[name].interval = window_estimate(text, name)
    drops: dict[str, list[float]] = {}
    drop_intervals: dict[str, list[PairedEstimate | None]] = {}
    counts: dict[str, int] = {}
    for t in task_list:
        res = tasks[t.name]
        cand = res["candidate"]
        for m in t.metrics:
            name = f"{t.name}.{m.metric}"
            cv = cand.metrics[m.metric]
            counts[m.metric] = counts.get(m.metric, 0) + 1
            if compare:
                bv = res["baseline"].metrics[m.metric]
                rows[name] = MetricRow(name, cv.value, bv.value, cv.value - bv.value, cv.stderr)
                drop = 100.0 * (bv.value - cv.value)
                est = task_drop(res["baseline"], cand, m.metric)
                rows[f"{name}_drop"] = MetricRow(f"{name}_drop", drop, stderr=_paired_stderr(
                    res["baseline"], cand, m.metric), interval=est)
                drops.setdefault(m.metric, []).append(drop)
                drop_intervals.setdefault(m.metric, []).append(est)
            else:
                rows[name] = MetricRow(name, cv.value, stderr=cv.stderr)
    for metric, values in drops.items():
        ests = drop_intervals[metric]
        rows[f"{metric}_drop"] = MetricRow(f"{metric}_drop", max(values),  # the worst task decides
                                           interval=None if None in ests else worst_drop(ests))  # type: ignore[arg-type]
    return rows


def _estimate(metric: str, confidence: float, rows: dict[str, MetricRow], text: TextScore | None,
              tasks: dict[str, dict[str, TaskResult]], task_list: list[Task]) -> PairedEstimate | None:
    """The paired interval of `metric` at `confidence` (the rows hold the 95% ones)."""
    row = rows.get(metric)
    if row is None:
        return None
    if confidence == DEFAULT_CONFIDENCE or row.interval is None:
        return row.interval
    if metric in WINDOW_METRICS:
        return window_estimate(text, metric, confidence) if text is not None else None
    per_task = []
    for t in task_list:
        for m in t.metrics:
            if metric in (f"{t.name}.{m.metric}_drop", f"{m.metric}_drop"):
                per_task.append(task_drop(tasks[t.name]["baseline"], tasks[t.name]["candidate"], m.metric,
                                          confidence))
    return None if None in per_task else worst_drop(per_task)  # type: ignore[arg-type]


def _check_gates(gates: list[ConfidenceGate], rows: dict[str, MetricRow], aliases: dict[str, str],
                 text: TextScore | None, tasks: dict[str, dict[str, TaskResult]],
                 task_list: list[Task]) -> list[GateResult]:
    """Plain gates read the point estimate; confidence gates the bound of their interval (llmopt.gates)."""
    out: list[GateResult] = []
    for cg in gates:
        name = aliases.get(cg.gate.metric, cg.gate.metric)
        row = rows.get(name)
        if cg.confidence is None:
            out += check_gates([cg.gate], lambda _m, row=row: row.candidate if row is not None else None)
        else:
            est = _estimate(name, cg.confidence, rows, text, tasks, task_list)
            res = check_interval_gate(cg, row.candidate if row is not None else None,
                                      est.low if est else None, est.high if est else None)
            if res.verdict == "not shown" and est is not None:
                res.note = undecided_note(est, cg)
            out.append(res)
        if row is not None:
            row.gates.append(cg.expression)
            row.passed = out[-1].passed if row.passed is None else (row.passed and out[-1].passed)
            label = "PASS" if out[-1].passed else ("NOT SHOWN" if getattr(out[-1], "verdict", "") == "not shown"
                                                   else "FAIL")
            order = ("PASS", "NOT SHOWN", "FAIL")
            row.verdict = label if row.verdict is None else max(row.verdict, label, key=order.index)
    return out


def check_inputs(opts: EvalOptions) -> tuple[str | None, list[Task], list[ConfidenceGate]]:
    """Every input and gate of `opts` read and checked, no model loaded: the eval text, the tasks and the
    gates (a caller with minutes of work before its first eval calls this first)."""
    text = load_text(opts.ppl_data) if opts.ppl_data is not None else None
    task_list = [load_task(p) for p in opts.tasks]
    for task in task_list:  # every scored document's prompt and choices, before any model loads
        task.requests(opts.limit)
    names = [t.name for t in task_list]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise LlmoptError(f"task {dup!r} is given twice")
    gates = parse_confidence_gates(opts.gates)
    _validate_gates(gates, metric_names(opts, task_list), interval_metric_names(opts, task_list))
    if opts.harness == "lm-eval" and task_list:
        _check_lmeval_models([opts.model] + ([opts.baseline] if opts.baseline else []))
    return text, task_list, gates


@dataclass
class _BaselineRun:
    model: dict[str, Any]
    score: TextScore | None
    reference: BaselineTopK | None
    ids: list[int]
    results: dict[str, TaskResult]


class BaselineCache:
    """Pass one to several `run_eval` calls that judge candidates against the same baseline (the gate search's
    trials): the baseline is measured by the first, and the others reuse its scores, top-k record and task
    results, as long as everything but the candidate and the gates is the same."""

    def __init__(self) -> None:
        self._key: str | None = None
        self._run: _BaselineRun | None = None

    @staticmethod
    def key(opts: EvalOptions) -> str:
        return opts.model_dump_json(exclude={"model", "gates", "bisect", "bisect_plot"})

    def get(self, opts: EvalOptions) -> _BaselineRun | None:
        return self._run if self._key == self.key(opts) else None

    def put(self, opts: EvalOptions, run: _BaselineRun) -> None:
        self._key, self._run = self.key(opts), run


def run_eval(opts: EvalOptions, progress: Callable[[str, int, int], None] | None = None,
             notify: Callable[[str], None] | None = None, baseline_cache: BaselineCache | None = None) -> EvalReport:
    """Measure everything `opts` asks for; gates are evaluated but not raised (see command.py). `notify`
    gets lines worth saying before they happen (what a float32 upcast will cost). `baseline_cache`: the
    baseline's measurements from an earlier call with the same options, reused (see BaselineCache)."""
    t0 = time.perf_counter()
    # 1. validate every input before loading a model
    text, task_list, gates = check_inputs(opts)
    # 2. each model in turn: the baseline first (its top-k log-probs are kept for KL), then the candidate
    batch = opts.max_batch_tokens or default_batch_tokens(opts.seq_len, resolve_device(opts.device))
    gen = any(t.output_type == "generate_until" for t in task_list)
    roles = ([("baseline", opts.baseline, opts.engine_options(batch, baseline=True, generation=gen))]
             if opts.baseline else []) + [("candidate", opts.model, opts.engine_options(batch, generation=gen))]
    reference = BaselineTopK(opts.kl_top_k) if opts.baseline and text is not None else None
    models: dict[str, dict[str, Any]] = {}
    scores: dict[str, TextScore] = {}
    results: dict[str, dict[str, TaskResult]] = {t.name: {} for t in task_list}
    ids: list[int] = []
    cand: LLM | None = None
    for role, model, engine_opts in roles:
        kept = baseline_cache.get(opts) if baseline_cache is not None and role == "baseline" else None
        if kept is not None:
            models[role], ids, reference = dict(kept.model), list(kept.ids), kept.reference
            if kept.score is not None:
                scores[role] = kept.score
            for task in task_list:
                results[task.name][role] = kept.results[task.name]
            continue
        note = float32_notice(model, engine_opts.dtype)
        if note and notify:
            notify(note)
        llm = build_llm(model, engine_opts)
        models[role] = {"model": model or "smollm2-135m", "dtype": str(llm.engine.dtype).removeprefix("torch."),
                        "kv_cache_dtype": llm.engine.config.kv_cache_dtype,
                        "kv_cache_scales": llm.engine.config.kv_cache_scales, "device": str(llm.engine.device),
                        "weight_bytes": weight_bytes(llm.engine.model)}
        # 3. perplexity (and, for the candidate, KL and top-1 agreement against the baseline's record)
        if text is not None:
            mine = llm.engine.tokenizer.encode(text)
            if opts.max_tokens:
                mine = mine[:opts.max_tokens]
            if ids and mine != ids:
                raise LlmoptError("baseline and candidate tokenize the eval text differently; perplexity, KL "
                                  "and top-1 agreement need the same tokenizer")
            ids = mine
            label = f"perplexity ({role})" if opts.baseline else "perplexity"
            scores[role] = score_text(
                llm.engine, ids, opts.seq_len, opts.stride, batch,
                progress=(lambda done, total, label=label: progress(label, done, total)) if progress else None,
                record=reference if role == "baseline" else None,
                compare_to=reference if role == "candidate" else None)
        # 4. tasks
        for task in task_list:
            if progress:
                progress(f"{task.name} ({role})", 0, 1)
            if opts.harness == "lm-eval":
                from llmopt.eval.harness_lmeval import evaluate_task_lmeval

                results[task.name][role] = evaluate_task_lmeval(model, task, opts.limit, dtype=engine_opts.dtype,
                                                                device=str(llm.engine.device))
            else:
                results[task.name][role] = evaluate_task(llm, task, opts.limit, max_batch_tokens=batch)
        if role == "baseline":  # freed before the candidate loads: the two are never in memory together
            if baseline_cache is not None:
                baseline_cache.put(opts, _BaselineRun(dict(models[role]), scores.get(role), reference, list(ids),
                                                      {t.name: results[t.name][role] for t in task_list}))
            device = llm.engine.device
            del llm
            free_memory(device)
        else:
            cand = llm
    score = None
    if text is not None:
        score = compare_scores(scores["baseline"], scores["candidate"]) if opts.baseline else scores["candidate"]
        if reference is not None:
            score.protocol.update({"kl_top_k": reference.top_k, "kl_exact": reference.exact,
                                   "baseline_rest_mass": reference.mean_rest_mass})
    bisect = None
    if opts.bisect and opts.baseline is not None and text is not None and cand is not None:
        base = build_llm(opts.baseline, opts.engine_options(batch, baseline=True))  # bisect swaps layers: both
        bisect = run_bisect(base, cand, opts.model, opts.baseline, opts.engine_options(batch),
                            opts.engine_options(batch, baseline=True), ids, opts.seq_len,
                            [cg.gate for cg in gates],
                            opts.bisect_plot, progress)
    rows = _build_rows(opts, score, results, task_list)
    gate_results = _check_gates(gates, rows, _aliases(task_list), score, results, task_list)
    return EvalReport(opts, models, score, results, rows, gate_results, time.perf_counter() - t0, bisect)
