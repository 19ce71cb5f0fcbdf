"""`llmopt bench --ab A --ab B`: the same work on two targets in interleaved rounds, compared by ratio.

A run on a shared machine measures the machine: its neighbours, its clock, its thermal state drift over
minutes by more than most optimizations gain. Two targets run one after the other see different
machines; two targets run in alternation see the same drift, which cancels in their ratio. So each round
runs the workload on both sides, in the order A B, B A, A B, ... (`abba`, the default: a drift that is
linear within two rounds cancels exactly) or A B A B (`abab`), and the ratios B/A get bootstrap
intervals over the rounds, paired by round (`ab_stats`).

In-process, both engines are loaded and held for the whole comparison (two models or two KV pools at
once), the requests are identical for both, and each run starts with an emptied prefix cache. Over
HTTP a server's cache cannot be emptied, so every run gets prompts of its own (the same lengths, other
tokens: `with_salt`) and neither side nor a later round can reuse another's prefix; a jsonl file's fixed
prompts are the exception, so its first round runs against a colder cache than the rest.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import Progress

from llmopt.bench.ab_gates import check_bench_gates
from llmopt.bench.ab_report import AbReport, AbSideResult, render_ab
from llmopt.bench.config import BenchConfig
from llmopt.bench.gate_metrics import RATIO_SUFFIX, RUN_METRICS
from llmopt.bench.http_target import HttpTarget, ServerMetrics, check_reachable
from llmopt.bench.levels import (
    engine_target_info,
    http_level,
    level_label,
    load_tokenizer,
    offline_level,
    probe_http,
)
from llmopt.bench.load import LoadPattern, LoadResult, make_progress
from llmopt.bench.offline import OfflineEngineTarget
from llmopt.bench.report import BenchReport, TargetInfo
from llmopt.bench.rounds import pool_rounds
from llmopt.bench.workload_spec import Work, describe_work, is_conversations, materialize, with_salt
from llmopt.errors import LlmoptError
from llmopt.gates import GateResult

if TYPE_CHECKING:
    from llmopt.engine.llm_engine import LLMEngine

Results = list[list[tuple[LoadResult, ServerMetrics | None]]]


def run_ab(cfg: BenchConfig, console: Console) -> tuple[AbReport, bool]:
    """Both sides, `cfg.ab.rounds` rounds each, interleaved; returns the report and whether Ctrl-C cut it."""
    assert cfg.ab is not None
    if len(cfg.loads) != 1:
        raise LlmoptError("--ab compares at one load level; give one --concurrency or --request-rate value")
    pattern = cfg.loads[0]
    with make_progress(console, cfg.progress) as progress:
        if cfg.ab.sides[0].http is not None:
            infos, results, sequence, interrupted = _run_http(cfg, pattern, progress, console)
        else:
            infos, results, sequence, interrupted = _run_offline(cfg, pattern, progress, console)
    sides = []
    for s, side in enumerate(cfg.ab.sides):
        got = results[s]
        runs = [pool_rounds([(res, sm) for res, sm, _ in got], cfg.slo, keep_samples=cfg.keep_samples,
                            label=got[0][2])] if got else []
        rep = BenchReport(target=infos[s], workload=cfg.workload, sweep=None, knee_metric=cfg.knee_metric,
                          knee_percentile=cfg.knee_percentile, slo=cfg.slo, runs=runs)
        sides.append(AbSideResult(name=side.name, spec=side.spec, report=rep))
    report = AbReport(order=cfg.ab.order, rounds=cfg.ab.rounds, confidence=cfg.ab.confidence,
                      seed=cfg.workload.seed if hasattr(cfg.workload, "seed") else 0,
                      sequence=sequence, sides=sides).with_ratios()
    render_ab(report, console)
    return report, interrupted


def check_ab_gates(report: AbReport, cfg: BenchConfig) -> list[GateResult]:
    """`X_ratio` gates read B/A (point or interval bound); plain `X` gates read side B's pooled run."""
    b = report.run(1)

    def value(metric: str) -> float | None:
        if metric.endswith(RATIO_SUFFIX):
            return report.ratio(metric.removesuffix(RATIO_SUFFIX)).ratio
        v = None if b is None else RUN_METRICS[metric](b)
        return None if v is None else float(v)

    return check_bench_gates(cfg.ab_gates, value,
                             lambda m, conf: report.ratio(m.removesuffix(RATIO_SUFFIX), conf))


# ------------------------------------------------------------------------------------------- in-process


def _run_offline(cfg: BenchConfig, pattern: LoadPattern, progress: Progress, console: Console
                 ) -> tuple[list[TargetInfo], Any, list[str], bool]:
    from llmopt.engine.llm_engine import LLMEngine

    assert cfg.ab is not None
    engines: list[LLMEngine] = []
    targets: list[OfflineEngineTarget] = []
    assert cfg.ab.sides[0].engine is not None
    # one workload, the same requests for both sides, built before any weights load
    work = materialize(cfg.workload, load_tokenizer(cfg.ab.sides[0].engine.model))
    console.print(f"[dim]workload: {describe_work(work)}[/]")
    try:
        for side in cfg.ab.sides:
            assert side.engine is not None
            console.print(f"[dim]loading side {side.name}: {side.engine.model or 'the embedded model'} ...[/]")
            engines.append(LLMEngine(side.engine))
            targets.append(OfflineEngineTarget(engines[-1], temperature=cfg.temperature))
        for t in targets:
            if not is_conversations(work):
                t.check_capacity(pattern, "continuous")
        infos = [engine_target_info(s.engine, e) for s, e in zip(cfg.ab.sides, engines, strict=True)]  # type: ignore[arg-type]

        def one(s: int, r: int) -> tuple[LoadResult, ServerMetrics | None]:
            return offline_level(targets[s], work, pattern, warmup=cfg.warmup, progress=progress,
                                 description=f"{cfg.ab.sides[s].name}, round {r + 1}/{cfg.ab.rounds}")  # type: ignore[union-attr]

        results, sequence, interrupted = _rounds(cfg, one, level_label(work, pattern))
    finally:
        for t in targets:
            t.close()
        engines.clear()
        gc.collect()
    return infos, results, sequence, interrupted


def _rounds(cfg: BenchConfig, one: Any, label: str) -> tuple[Any, list[str], bool]:
    """The interleaved loop: per round, both sides in the round's order; stops at an interrupted run."""
    assert cfg.ab is not None
    results: list[list[tuple[LoadResult, ServerMetrics | None, str]]] = [[], []]
    sequence: list[str] = []
    for r in range(cfg.ab.rounds):
        for s in cfg.ab.sequence(r):
            try:
                res, sm = one(s, r)
            except KeyboardInterrupt:
                return results, sequence, True
            if res.records:
                results[s].append((res, sm, label))
                sequence.append(cfg.ab.sides[s].name)
            if res.interrupted:
                return results, sequence, True
    return results, sequence, False


# ------------------------------------------------------------------------------------------------- HTTP


def _run_http(cfg: BenchConfig, pattern: LoadPattern, progress: Progress, console: Console
              ) -> tuple[list[TargetInfo], Any, list[str], bool]:
    assert cfg.ab is not None
    for side in cfg.ab.sides:
        assert side.http is not None
        check_reachable(side.http.base_url)
    needs_tokenizer = cfg.workload.kind != "jsonl" or cfg.tokenizer is not None
    tokenizer = load_tokenizer(cfg.tokenizer) if needs_tokenizer else None
    # every run its own prompt tokens (same lengths): no side or round is served from another's cache
    works = [[materialize(with_salt(cfg.workload, 2 * r + s), tokenizer) for s in range(2)]
             for r in range(cfg.ab.rounds)]
    console.print(f"[dim]workload (per run): {describe_work(works[0][0])}[/]")
    return asyncio.run(_http_rounds(cfg, pattern, works, progress))


async def _http_rounds(cfg: BenchConfig, pattern: LoadPattern, works: Sequence[Sequence[Work]],
                       progress: Progress) -> tuple[list[TargetInfo], Any, list[str], bool]:
    assert cfg.ab is not None
    targets = [HttpTarget(side.http) for side in cfg.ab.sides]  # type: ignore[arg-type]
    try:
        for t, w in zip(targets, works[0], strict=True):
            await t.prepare()
            if not is_conversations(w):
                t.validate_requests(w)  # type: ignore[arg-type]
            await probe_http(t, w)
        infos = [TargetInfo(kind="http", url=t.base_url, model=t.model, endpoint=t.config.endpoint,
                            server=t.owned_by) for t in targets]
        results: list[list[tuple[LoadResult, ServerMetrics | None, str]]] = [[], []]
        sequence: list[str] = []
        label = level_label(works[0][0], pattern)
        interrupted = False
        for r in range(cfg.ab.rounds):
            for s in cfg.ab.sequence(r):
                try:
                    res, sm = await http_level(targets[s], works[r][s], pattern, warmup=cfg.warmup,
                                               progress=progress,
                                               description=f"{cfg.ab.sides[s].name}, round {r + 1}/{cfg.ab.rounds}")
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None:
                        task.uncancel()
                    return infos, results, sequence, True
                if res.records:
                    results[s].append((res, sm, label))
                    sequence.append(cfg.ab.sides[s].name)
                if res.interrupted:
                    interrupted = True
                    break
            if interrupted:
                break
        return infos, results, sequence, interrupted
    finally:
        for t in targets:
            await t.aclose()
