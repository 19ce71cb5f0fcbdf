"""`run_bench(cfg)`: one `llmopt bench` invocation from a `BenchConfig` to printed and written results.

The steps are the same for both targets: build the workload with the target's tokenizer, run every load
level (a warm-up first, discarded), collect what the target counted meanwhile, find the knee, print,
write the files, check the gates. Only the driver differs: `HttpTarget` under asyncio for a server,
`OfflineEngineTarget` stepping the engine in this thread for `--model`. A scenario repeats the offline
sweep for each engine variant and adds the comparison.

Faults never crash a run: failed requests are counted (see `load.py` and `offline.py`). Ctrl-C stops the
sweep after the current level; whatever finished is still printed and written, and
`BenchOutcome.interrupted` tells the CLI to exit 130. Gates are not checked on interrupted results.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field
from rich.console import Console
from rich.progress import Progress

from llmopt.bench.ab_report import AbReport, write_ab_json, write_ab_markdown
from llmopt.bench.config import BenchConfig
from llmopt.bench.gate_metrics import check_report_gates, check_scenario_gates
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
from llmopt.bench.offline import Batching, OfflineEngineTarget
from llmopt.bench.report import (
    BenchReport,
    BenchRun,
    Comparison,
    TargetInfo,
    render_comparison,
    render_report,
    write_json,
    write_markdown,
    write_plot,
)
from llmopt.bench.rounds import pool_rounds
from llmopt.bench.scenario_report import (
    ScenarioReport,
    VariantResult,
    compare_files,
    render_scenario,
    write_scenario_json,
    write_scenario_markdown,
    write_scenario_plot,
)
from llmopt.bench.workload_spec import Work, describe_work, is_conversations, materialize, with_salt
from llmopt.errors import LlmoptError
from llmopt.gates import GateResult, failure_message

if TYPE_CHECKING:
    from llmopt.engine.config import EngineConfig
    from llmopt.engine.llm_engine import LLMEngine


class BenchInterrupted(LlmoptError):
    """Ctrl-C ended the benchmark early; the CLI exits 130 (after printing whatever finished)."""

    exit_code = 130


class BenchOutcome(BaseModel):
    """What `run_bench` did: the report (or scenario report), gate results, and whether it was cut short."""

    report: BenchReport | None = None
    scenario: ScenarioReport | None = None
    ab: AbReport | None = None
    gates: list[GateResult] = Field(default_factory=list)
    interrupted: bool = False
    written: list[str] = Field(default_factory=list, description="Files written (--json, --markdown, --plot).")

    @property
    def gate_failure(self) -> str | None:
        """One line naming every failed gate, or None."""
        return failure_message(self.gates)


# --------------------------------------------------------------------------------------- entry points


def run_bench(cfg: BenchConfig, console: Console | None = None) -> BenchOutcome:
    """Run the benchmark `cfg` describes, print it to `console`, write the requested files."""
    console = console or Console()
    if cfg.ab is not None:
        from llmopt.bench.ab import run_ab

        ab, interrupted = run_ab(cfg, console)
        outcome = BenchOutcome(ab=ab, interrupted=interrupted)
    elif cfg.http is not None:
        outcome = _run_http(cfg, console)
    elif cfg.scenario is not None:
        outcome = _run_scenario(cfg, console)
    else:
        outcome = _run_offline(cfg, console)
    if not outcome.interrupted:
        if outcome.ab is not None and cfg.ab_gates:
            from llmopt.bench.ab import check_ab_gates

            outcome.gates = check_ab_gates(outcome.ab, cfg)
        elif cfg.gates:
            outcome.gates = (check_scenario_gates(outcome.scenario, cfg.gates) if outcome.scenario is not None
                             else check_report_gates(outcome.report, cfg.gates))  # type: ignore[arg-type]
    write_outputs(cfg, outcome)  # the HTML page shows the gates, so they are checked first
    for path in outcome.written:
        console.print(f"[dim]wrote {path}[/]")
    if outcome.interrupted:
        console.print("[bold yellow]interrupted:[/] partial results above; gates were not checked")
        return outcome
    for g in outcome.gates:
        color = "green" if g.passed else "red"
        console.print(f"[bold {color}]gate[/] {g.describe()}", highlight=False)
    return outcome


def show_comparison(paths: Sequence[str], console: Console | None = None) -> Comparison:
    """`--compare A.json B.json ...`: one table, every metric with its ratio to the first report."""
    cmp = compare_files(paths)
    render_comparison(cmp, console or Console())
    return cmp


# ------------------------------------------------------------------------------------------ outputs


def write_outputs(cfg: BenchConfig, outcome: BenchOutcome) -> None:
    """The files `cfg` asks for (--json, --markdown, --plot, --html) of `outcome`; their paths in `outcome.written`.
    Public for callers that run the benchmark without them and write them after (a recipe's bench stage)."""
    if outcome.ab is not None:
        result: Any = outcome.ab
        writers: tuple[Any, ...] = (write_ab_json, write_ab_markdown, None)
    elif outcome.scenario is not None:
        result = outcome.scenario
        writers = (write_scenario_json, write_scenario_markdown, write_scenario_plot)
    elif outcome.report is not None:
        result, writers = outcome.report, (write_json, write_markdown, write_plot)
    else:
        outcome.written = []
        return
    paths = (cfg.json_path, cfg.markdown_path, cfg.plot_path)
    outcome.written = [str(write(result, path)) for write, path in zip(writers, paths, strict=True) if path]
    if cfg.html_path:
        from llmopt.bench.html_report import bench_page
        from llmopt.report.html import write_html

        outcome.written.append(str(write_html(cfg.html_path, bench_page(result, outcome.gates))))


def _report(cfg: BenchConfig, target: TargetInfo, runs: list[BenchRun]) -> BenchReport:
    rep = BenchReport(target=target, workload=cfg.workload, sweep=cfg.sweep, knee_metric=cfg.knee_metric,
                      knee_percentile=cfg.knee_percentile, slo=cfg.slo, runs=runs)
    return rep.with_knee() if len(runs) > 1 else rep


# ------------------------------------------------------------------------------------------- offline


class _EngineCache:
    """Keeps one engine alive and rebuilds it only when a variant needs a different EngineConfig.

    The old engine is dropped before the new one is built, so two KV pools never coexist in memory.
    """

    def __init__(self, console: Console):
        self.console = console
        self.config: EngineConfig | None = None
        self.engine: LLMEngine | None = None

    def get(self, config: EngineConfig) -> LLMEngine:
        if self.engine is not None and self.config == config:
            return self.engine
        self.close()
        from llmopt.engine.llm_engine import LLMEngine

        self.console.print(f"[dim]loading {config.model or 'the embedded model'} into the engine ...[/]")
        self.engine = LLMEngine(config)
        self.config = config
        self.console.print(f"[dim]engine on {self.engine.device}, {self.engine.threads.describe()}[/]")
        return self.engine

    def close(self) -> None:
        if self.engine is None:
            return
        from llmopt.devices import free_memory

        device = self.engine.device
        self.engine = None
        self.config = None
        free_memory(device)


def _variant_config(base: EngineConfig, overrides: dict[str, Any]) -> EngineConfig:
    from llmopt.engine.config import EngineConfig

    return EngineConfig(**{**base.model_dump(), **overrides})


def _offline_sweep(cfg: BenchConfig, engine: LLMEngine, work: Work, progress: Progress,
                   batching: Batching = "continuous", name: str | None = None) -> tuple[list[BenchRun], bool]:
    """Every load level (each `cfg.rounds` times) on one engine; stops after an interrupted level."""
    target = OfflineEngineTarget(engine, temperature=cfg.temperature)
    runs: list[BenchRun] = []
    try:
        for pattern in cfg.loads:
            target.check_capacity(pattern, batching)
        for pattern in cfg.loads:
            label = _label(pattern, batching, work)
            results = []
            for r in range(cfg.rounds):
                desc = label if cfg.rounds == 1 else f"{label}, round {r + 1}/{cfg.rounds}"
                try:
                    result, counters = offline_level(target, work, pattern, warmup=cfg.warmup, batching=batching,
                                                     progress=progress, description=f"{name}: {desc}" if name else desc)
                except KeyboardInterrupt:  # between requests (warm-up bookkeeping): keep the finished levels
                    return runs, True
                results.append((result, counters))
                if result.interrupted:
                    break
            runs.append(_run_of(cfg, results, label))
            if results[-1][0].interrupted:
                return runs, True
    finally:
        target.close()
    return runs, False


def _run_of(cfg: BenchConfig, results: list[tuple[LoadResult, ServerMetrics | None]], label: str) -> BenchRun:
    """A level's run: one round as it is, several pooled (with each round kept)."""
    if len(results) == 1:
        run = BenchRun.from_load(results[0][0], cfg.slo, results[0][1], keep_samples=cfg.keep_samples)
        run.label = label
        return run
    return pool_rounds(results, cfg.slo, keep_samples=cfg.keep_samples, label=label)


def _label(pattern: LoadPattern, batching: Batching, work: Work) -> str:
    return f"static batches of {pattern.concurrency}" if batching == "static" else level_label(work, pattern)


def _build_workload(cfg: BenchConfig, tokenizer: Any, console: Console, salt: int | None = None) -> Work:
    work = materialize(cfg.workload if salt is None else with_salt(cfg.workload, salt), tokenizer)
    if salt is None or salt == 0:
        console.print(f"[dim]workload: {describe_work(work)}[/]")
    return work


def _run_offline(cfg: BenchConfig, console: Console) -> BenchOutcome:
    assert cfg.engine is not None
    work = _build_workload(cfg, load_tokenizer(cfg.engine.model), console)  # a bad workload fails before the weights load
    engines = _EngineCache(console)
    try:
        engine = engines.get(cfg.engine)
        info = engine_target_info(cfg.engine, engine)
        with make_progress(console, cfg.progress) as progress:
            runs, interrupted = _offline_sweep(cfg, engine, work, progress)
    finally:
        engines.close()
    report = _report(cfg, info, runs)
    render_report(report, console)
    return BenchOutcome(report=report, interrupted=interrupted)


def _run_scenario(cfg: BenchConfig, console: Console) -> BenchOutcome:
    assert cfg.engine is not None and cfg.scenario is not None
    scen = cfg.scenario
    engines = _EngineCache(console)
    results: list[VariantResult] = []
    interrupted = False
    # one workload for all variants (they share the model), built before any weights load
    requests = _build_workload(cfg, load_tokenizer(cfg.engine.model), console)
    try:
        with make_progress(console, cfg.progress) as progress:
            for variant in scen.variants:
                vcfg = _variant_config(cfg.engine, variant.engine_overrides)
                engine = engines.get(vcfg)
                runs, interrupted = _offline_sweep(cfg, engine, requests, progress, variant.batching,
                                                   variant.name)
                results.append(VariantResult(name=variant.name, description=variant.description,
                                             batching=variant.batching, engine_overrides=variant.engine_overrides,
                                             report=_report(cfg, engine_target_info(vcfg, engine), runs)))
                if interrupted:
                    break
    finally:
        engines.close()
    rep = ScenarioReport.build(scen.name, scen.description, results)
    render_scenario(rep, console)
    return BenchOutcome(scenario=rep, interrupted=interrupted)


# ---------------------------------------------------------------------------------------------- HTTP


def _run_http(cfg: BenchConfig, console: Console) -> BenchOutcome:
    assert cfg.http is not None
    check_reachable(cfg.http.base_url)  # fail fast, before loading a tokenizer
    needs_tokenizer = cfg.workload.kind != "jsonl" or cfg.tokenizer is not None
    tokenizer = load_tokenizer(cfg.tokenizer) if needs_tokenizer else None
    # a server's prefix cache cannot be emptied between rounds: each round gets its own prompt tokens
    works = ([_build_workload(cfg, tokenizer, console)] if cfg.rounds == 1 else
             [_build_workload(cfg, tokenizer, console, salt=r) for r in range(cfg.rounds)])
    with make_progress(console, cfg.progress) as progress:
        info, runs, interrupted = asyncio.run(_http_sweep(cfg, works, progress))
    report = _report(cfg, info, runs)
    render_report(report, console)
    return BenchOutcome(report=report, interrupted=interrupted)


async def _http_sweep(cfg: BenchConfig, works: list[Work], progress: Progress
                      ) -> tuple[TargetInfo, list[BenchRun], bool]:
    """Every load level against the server (each round with its own work), with a /metrics diff around
    each measured run.

    Ctrl-C cancels this task; `run_load` turns that into a partial result, and a cancellation that lands
    between runs (during a scrape or the warm-up) ends the sweep here. Either way we return normally.
    """
    assert cfg.http is not None
    runs: list[BenchRun] = []
    interrupted = False
    async with HttpTarget(cfg.http) as target:
        for work in works:
            if not is_conversations(work):
                target.validate_requests(work)  # type: ignore[arg-type]
        await probe_http(target, works[0])
        info = TargetInfo(kind="http", url=target.base_url, model=target.model, endpoint=cfg.http.endpoint,
                          server=target.owned_by)
        for pattern in cfg.loads:
            label = level_label(works[0], pattern)
            results: list[tuple[LoadResult, ServerMetrics | None]] = []
            for r, work in enumerate(works):
                desc = label if len(works) == 1 else f"{label}, round {r + 1}/{len(works)}"
                try:
                    result, counters = await http_level(target, work, pattern, warmup=cfg.warmup, progress=progress,
                                                        description=desc)
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None:
                        task.uncancel()  # handled: stop the sweep and return what finished
                    interrupted = True
                    break
                if result.interrupted and not result.records:
                    interrupted = True
                    break
                results.append((result, counters))
                if result.interrupted:
                    interrupted = True
                    break
            if results:
                runs.append(_run_of(cfg, results, label))
            if interrupted:
                break
    return info, runs, interrupted
