"""One measured run of one load level on one target, for any workload: the step that sweeps, rounds and
A/B benchmarks all repeat.

In-process, `offline_level` runs a warm-up, empties the prefix cache and runs the level; over HTTP,
`http_level` runs a warm-up, then the level between two scrapes of `/metrics`. Flat workloads go through
`OfflineEngineTarget.run` / `run_load`; conversation scripts through `conversation_driver`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.progress import Progress

from llmopt.bench import conversation_driver
from llmopt.bench.http_target import HttpTarget, ServerMetrics, diff_metrics, scrape_metrics
from llmopt.bench.load import LoadPattern, LoadResult, run_load, warmup_requests
from llmopt.bench.offline import Batching, OfflineEngineTarget
from llmopt.bench.report import TargetInfo
from llmopt.bench.workload_spec import Work, is_conversations

if TYPE_CHECKING:
    from llmopt.engine.config import EngineConfig
    from llmopt.engine.llm_engine import LLMEngine


def offline_level(target: OfflineEngineTarget, work: Work, pattern: LoadPattern, *, warmup: int,
                  batching: Batching = "continuous", progress: Progress | None = None,
                  description: str | None = None) -> tuple[LoadResult, ServerMetrics]:
    """Warm-up, emptied prefix cache, then the measured run with the engine's own counters."""
    if is_conversations(work):
        return conversation_driver.run_offline(target, work, warmup=warmup, progress=progress,  # type: ignore[arg-type]
                                               description=description or "conversations")
    return target.run(work, pattern, batching=batching, warmup=warmup, progress=progress,  # type: ignore[arg-type]
                      description=description)


async def probe_http(target: HttpTarget, work: Work) -> None:
    """`HttpTarget.probe` on the API the work's requests go to, before its first level."""
    if is_conversations(work):
        chat = target.config.endpoint != "completions"  # as conversation_driver.run_http sends them
    else:
        chat = bool(work) and target.endpoint_for(work[0]) == "chat"  # type: ignore[arg-type]
    await target.probe(chat)


async def http_level(target: HttpTarget, work: Work, pattern: LoadPattern, *, warmup: int,
                     progress: Progress, description: str | None = None
                     ) -> tuple[LoadResult, ServerMetrics | None]:
    """Warm-up, then the measured run between two `/metrics` scrapes (their difference is the run's)."""
    desc = description or pattern.label()
    conv = is_conversations(work)
    if warmup:
        warm = (conversation_driver.first_turns(work, warmup, chat=target.config.endpoint != "completions")  # type: ignore[arg-type]
                if conv else warmup_requests(work, warmup))  # type: ignore[arg-type]
        res = await run_load(target.send, warm, LoadPattern(concurrency=pattern.concurrency), progress=progress,
                             description=f"warm-up ({desc})")
        progress.remove_task(progress.task_ids[-1])
        if res.interrupted:
            return LoadResult(pattern=pattern, records=[], duration_s=0.0, interrupted=True), None
    before = await scrape_metrics(target.base_url, client=target.client)
    if conv:
        result = await conversation_driver.run_http(target, work, progress=progress, description=desc)  # type: ignore[arg-type]
    else:
        result = await run_load(target.send, work, pattern, progress=progress, description=desc)  # type: ignore[arg-type]
    after = None if result.interrupted else await scrape_metrics(target.base_url, client=target.client)
    return result, diff_metrics(before, after)


def level_label(work: Work, pattern: LoadPattern) -> str:
    if is_conversations(work):
        return f"{len(work)} users x {work[0].turns} turns"  # type: ignore[union-attr]
    return pattern.label()


def engine_target_info(config: EngineConfig, engine: LLMEngine) -> TargetInfo:
    from llmopt.models.resolve import DEFAULT_MODEL

    details = config.model_dump(mode="json")
    details.update(resolved_dtype=str(engine.dtype).removeprefix("torch."), resolved_device=str(engine.device),
                   num_kv_blocks=engine.num_blocks, max_model_len=engine.max_model_len,
                   threads=engine.threads.threads)
    return TargetInfo(kind="offline", model=config.model or DEFAULT_MODEL, server="llmopt", engine=details)


def load_tokenizer(model: str | None) -> Any:
    """The tokenizer of MODEL (alias, HF directory or .gguf; None: the embedded model), without weights, for
    the prompts' text (and without torch, for a client: `load_text_tokenizer`)."""
    from llmopt.models.resolve import resolve_model, weights_dir
    from llmopt.models.tokenizer import load_text_tokenizer as load_from_directory

    return load_from_directory(weights_dir(resolve_model(model)))
