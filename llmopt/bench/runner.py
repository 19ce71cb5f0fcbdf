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
import gc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field
from rich.console import Console
from rich.progress import Progress

from llmopt.bench.config import BenchConfig
from llmopt.bench.gate_metrics import check_report_gates, check_scenario_gates
from llmopt.bench.http_target import HttpTarget, check_reachable, diff_metrics, scrape_metrics
from llmopt.bench.load import LoadPattern, make_progress, run_load
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
from llmopt.bench.scenario_report import (
    ScenarioReport,
    VariantResult,
    compare_files,
    render_scenario,
    write_scenario_json,
    write_scenario_markdown,
    write_scenario_plot,
)
from llmopt.bench.workloads import BenchRequest, build_requests, describe_lengths
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
    if cfg.http is not None:
        outcome = _run_http(cfg, console)
    elif cfg.scenario is not None:
        outcome = _run_scenario(cfg, console)
    else:
        outcome = _run_offline(cfg, console)
    _write_outputs(cfg, outcome)
    for path in outcome.written:
        console.print(f"[dim]wrote {path}[/]")
    if outcome.interrupted:
        console.print("[bold yellow]interrupted:[/] partial results above; gates were not checked")
        return outcome
    if cfg.gates:
        outcome.gates = (check_scenario_gates(outcome.scenario, cfg.gates) if outcome.scenario is not None
                         else check_report_gates(outcome.report, cfg.gates))  # type: ignore[arg-type]
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


def _write_outputs(cfg: BenchConfig, outcome: BenchOutcome) -> None:
    if outcome.scenario is not None:
        result: Any = outcome.scenario
        writers = (write_scenario_json, write_scenario_markdown, write_scenario_plot)
    elif outcome.report is not None:
        result, writers = outcome.report, (write_json, write_markdown, write_plot)
    else:
        outcome.written = []
        return
    paths = (cfg.json_path, cfg.markdown_path, cfg.plot_path)
    outcome.written = [str(write(result, path)) for write, path in zip(writers, paths, strict=True) if path]


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
        return self.engine

    def close(self) -> None:
        if self.engine is None:
            return
        device = self.engine.device
        self.engine = None
        self.config = None
        gc.collect()
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()


def _engine_target_info(config: EngineConfig, engine: LLMEngine) -> TargetInfo:
    from llmopt.models.resolve import DEFAULT_MODEL

    details = config.model_dump(mode="json")
    details.update(resolved_dtype=str(engine.dtype).removeprefix("torch."), resolved_device=str(engine.device),
                   num_kv_blocks=engine.num_blocks, max_model_len=engine.max_model_len)
    return TargetInfo(kind="offline", model=config.model or DEFAULT_MODEL, server="llmopt", engine=details)


def _variant_config(base: EngineConfig, overrides: dict[str, Any]) -> EngineConfig:
    from llmopt.engine.config import EngineConfig

    return EngineConfig(**{**base.model_dump(), **overrides})


def _offline_sweep(cfg: BenchConfig, engine: LLMEngine, requests: list[BenchRequest], progress: Progress,
                   batching: Batching = "continuous", name: str | None = None) -> tuple[list[BenchRun], bool]:
    """Every load level on one engine; stops after an interrupted level."""
    target = OfflineEngineTarget(engine, temperature=cfg.temperature)
    runs: list[BenchRun] = []
    try:
        for pattern in cfg.loads:
            target.check_capacity(pattern, batching)
        for pattern in cfg.loads:
            label = _label(pattern, batching)
            try:
                result, counters = target.run(requests, pattern, batching=batching, warmup=cfg.warmup,
                                              progress=progress, description=f"{name}: {label}" if name else label)
            except KeyboardInterrupt:  # between requests (warm-up bookkeeping): keep the finished levels
                return runs, True
            run = BenchRun.from_load(result, cfg.slo, counters, keep_samples=cfg.keep_samples)
            run.label = label
            runs.append(run)
            if result.interrupted:
                return runs, True
    finally:
        target.close()
    return runs, False


def _label(pattern: LoadPattern, batching: Batching) -> str:
    return f"static batches of {pattern.concurrency}" if batching == "static" else pattern.label()


def _build_workload(cfg: BenchConfig, tokenizer: Any, console: Console) -> list[BenchRequest]:
    requests = build_requests(cfg.workload, tokenizer)
    console.print(f"[dim]workload: {describe_lengths(requests)}[/]")
    return requests


def _run_offline(cfg: BenchConfig, console: Console) -> BenchOutcome:
    assert cfg.engine is not None
    engines = _EngineCache(console)
    try:
        engine = engines.get(cfg.engine)
        requests = _build_workload(cfg, engine.tokenizer, console)
        info = _engine_target_info(cfg.engine, engine)
        with make_progress(console, cfg.progress) as progress:
            runs, interrupted = _offline_sweep(cfg, engine, requests, progress)
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
    try:
        requests: list[BenchRequest] | None = None
        with make_progress(console, cfg.progress) as progress:
            for variant in scen.variants:
                vcfg = _variant_config(cfg.engine, variant.engine_overrides)
                engine = engines.get(vcfg)
                if requests is None:  # one workload for all variants, built with the first engine's tokenizer
                    requests = _build_workload(cfg, engine.tokenizer, console)
                runs, interrupted = _offline_sweep(cfg, engine, requests, progress, variant.batching,
                                                   variant.name)
                results.append(VariantResult(name=variant.name, description=variant.description,
                                             batching=variant.batching, engine_overrides=variant.engine_overrides,
                                             report=_report(cfg, _engine_target_info(vcfg, engine), runs)))
                if interrupted:
                    break
    finally:
        engines.close()
    rep = ScenarioReport.build(scen.name, scen.description, results)
    render_scenario(rep, console)
    return BenchOutcome(scenario=rep, interrupted=interrupted)


# ---------------------------------------------------------------------------------------------- HTTP


def load_tokenizer(model: str | None) -> Any:
    """The tokenizer of MODEL (alias, HF directory or .gguf; None: the embedded model), without weights."""
    from llmopt.models.resolve import resolve_model, weights_dir
    from llmopt.models.tokenizer import load_tokenizer as load_from_directory

    return load_from_directory(weights_dir(resolve_model(model)))


def _run_http(cfg: BenchConfig, console: Console) -> BenchOutcome:
    assert cfg.http is not None
    check_reachable(cfg.http.base_url)  # fail fast, before loading a tokenizer
    needs_tokenizer = cfg.workload.kind != "jsonl" or cfg.tokenizer is not None
    tokenizer = load_tokenizer(cfg.tokenizer) if needs_tokenizer else None
    requests = _build_workload(cfg, tokenizer, console)
    with make_progress(console, cfg.progress) as progress:
        info, runs, interrupted = asyncio.run(_http_sweep(cfg, requests, progress))
    report = _report(cfg, info, runs)
    render_report(report, console)
    return BenchOutcome(report=report, interrupted=interrupted)


async def _http_sweep(cfg: BenchConfig, requests: list[BenchRequest], progress: Progress
                      ) -> tuple[TargetInfo, list[BenchRun], bool]:
    """Every load level against the server, with a /metrics diff around each measured run.

    Ctrl-C cancels this task; `run_load` turns that into a partial result, and a cancellation that lands
    between runs (during a scrape or the warm-up) ends the sweep here. Either way we return normally.
    """
    assert cfg.http is not None
    runs: list[BenchRun] = []
    interrupted = False
    async with HttpTarget(cfg.http) as target:
        target.validate_requests(requests)
        info = TargetInfo(kind="http", url=target.base_url, model=target.model, endpoint=cfg.http.endpoint,
                          server=target.owned_by)
        for pattern in cfg.loads:
            try:
                if cfg.warmup:
                    warm = [requests[i % len(requests)] for i in range(cfg.warmup)]
                    res = await run_load(target.send, warm, LoadPattern(concurrency=pattern.concurrency),
                                         progress=progress, description=f"warm-up ({pattern.label()})")
                    progress.remove_task(progress.task_ids[-1])
                    if res.interrupted:
                        interrupted = True
                        break
                before = await scrape_metrics(target.base_url, client=target.client)
                result = await run_load(target.send, requests, pattern, progress=progress)
                after = None if result.interrupted else await scrape_metrics(target.base_url, client=target.client)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()  # handled: stop the sweep and return what finished
                interrupted = True
                break
            runs.append(BenchRun.from_load(result, cfg.slo, diff_metrics(before, after),
                                           keep_samples=cfg.keep_samples))
            if result.interrupted:
                interrupted = True
                break
    return info, runs, interrupted
