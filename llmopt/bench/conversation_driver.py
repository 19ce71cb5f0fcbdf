"""Drive conversation scripts against a target: every user runs its turns in order, each turn's prompt
being the previous prompt + the answer + the next message, with the script's think time after an answer.

In-process, the engine is stepped in this thread as in `offline.py`: a turn is added when its user is
ready (previous answer's last token + think time), with that moment as its arrival time, so a wait for
the step boundary counts in its TTFT. Over HTTP every user is an asyncio task. Records carry `turn`; a
failed turn ends its user's conversation (there is no answer to continue from).
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rich.progress import Progress

from llmopt.bench.conversations import ConversationScript, next_history, turn_request
from llmopt.bench.http_target import HttpTarget, ServerMetrics
from llmopt.bench.load import LoadPattern, LoadResult
from llmopt.bench.offline import OfflineEngineTarget, _abort_quietly, _record
from llmopt.bench.records import ERROR_INTERRUPTED, RequestRecord
from llmopt.errors import LlmoptError

if TYPE_CHECKING:
    from llmopt.bench.workloads import BenchRequest


def first_turns(scripts: Sequence[ConversationScript], n: int, *, chat: bool) -> list[BenchRequest]:
    """Warm-up requests: the opening messages of the first `n` users (cyclically)."""
    return [turn_request(scripts[i % len(scripts)], 0, [], chat=chat) for i in range(n)]


def _counter(progress: Progress | None, description: str, total: int) -> Callable[[RequestRecord], None]:
    task = progress.add_task(description, total=total, failed=0) if progress is not None else None
    failed = 0

    def on_done(rec: RequestRecord) -> None:
        nonlocal failed
        failed += not rec.success
        if progress is not None and task is not None:
            progress.update(task, advance=1, failed=failed)

    return on_done


def _pattern(scripts: Sequence[ConversationScript]) -> LoadPattern:
    return LoadPattern(concurrency=len(scripts))


# ------------------------------------------------------------------------------------------- in-process


def run_offline(target: OfflineEngineTarget, scripts: Sequence[ConversationScript], *, warmup: int = 0,
                progress: Progress | None = None, description: str = "conversations"
                ) -> tuple[LoadResult, ServerMetrics]:
    """Warm-up (opening messages, discarded), an emptied prefix cache, then every conversation."""
    if warmup:
        target.run(first_turns(scripts, warmup, chat=False), LoadPattern(concurrency=len(scripts)), warmup=0,
                   progress=None)
    target.engine.reset_prefix_cache()
    target.collector.reset()
    total = sum(s.turns for s in scripts)
    records, duration, stopped = _drive(target, scripts, _counter(progress, description, total))
    return (LoadResult(pattern=_pattern(scripts), records=records, duration_s=duration, interrupted=stopped),
            target.collector.server_metrics())


def _drive(target: OfflineEngineTarget, scripts: Sequence[ConversationScript],
           on_done: Callable[[RequestRecord], None]) -> tuple[list[RequestRecord], float, bool]:
    eng = target.engine
    t0 = time.perf_counter()
    ready: list[tuple[float, int]] = [(t0, u) for u in range(len(scripts))]  # (ready since, user)
    turn = [0] * len(scripts)
    history: list[list[Any]] = [[] for _ in scripts]
    in_flight: dict[str, tuple[int, BenchRequest]] = {}
    records: list[RequestRecord] = []
    interrupted = False

    def finish(u: int, rec: RequestRecord, req: BenchRequest, answer: list[int] | None = None) -> None:
        s = scripts[u]
        rec.turn, rec.index = turn[u], u * s.turns + turn[u]
        records.append(rec)
        on_done(rec)
        if rec.success and turn[u] + 1 < s.turns:
            history[u] = next_history(req, answer or [], chat=False)
            heapq.heappush(ready, (rec.end + s.think_s[turn[u]], u))
            turn[u] += 1

    try:
        while ready or in_flight:
            now = time.perf_counter()
            while ready and ready[0][0] <= now:
                since, u = heapq.heappop(ready)
                req = turn_request(scripts[u], turn[u], history[u], chat=False)
                rid = f"conv-{next(target._ids)}"
                try:
                    eng.add_request(rid, prompt_token_ids=target.prompt_ids(req), params=target._params(req),
                                    arrival_time=since)
                except LlmoptError as e:  # the history outgrew the model: this conversation ends here
                    finish(u, RequestRecord.failure(start=since, end=time.perf_counter(), error_code="rejected",
                                                    error=str(e), prompt_tokens=req.expected_prompt_tokens or 0),
                           req)
                    continue
                in_flight[rid] = (u, req)
            if not in_flight:
                if ready:
                    time.sleep(max(0.0, ready[0][0] - time.perf_counter()))
                continue
            try:
                outputs = eng.step()
            except Exception as e:  # the engine failed this step: those turns fail, their users stop
                for rid, (u, req) in list(in_flight.items()):
                    del in_flight[rid]
                    _abort_quietly(eng, rid)
                    finish(u, RequestRecord.failure(start=t0, end=time.perf_counter(),
                                                    error_code=f"exception:{type(e).__name__}",
                                                    error=f"{type(e).__name__}: {e}"), req)
                continue
            for out in outputs:
                if out.finished and out.request_id in in_flight:
                    u, req = in_flight.pop(out.request_id)
                    finish(u, _record(out), req, list(out.outputs[0].token_ids))
    except KeyboardInterrupt:
        interrupted = True
        now = time.perf_counter()
        for rid, (u, _req) in in_flight.items():
            records.append(RequestRecord.failure(start=now, end=now, error_code=ERROR_INTERRUPTED,
                                                 error="run interrupted", interrupted=True, index=u))
            _abort_quietly(eng, rid)
    return sorted(records, key=lambda r: r.index), time.perf_counter() - t0, interrupted


# ------------------------------------------------------------------------------------------------- HTTP


async def run_http(target: HttpTarget, scripts: Sequence[ConversationScript], *,
                   progress: Progress | None = None, description: str = "conversations") -> LoadResult:
    """Every user as a task: send a turn, keep the answer, think, send the next. Cancellation (Ctrl-C)
    returns what finished, the turns in flight marked interrupted."""
    chat = target.config.endpoint != "completions"
    on_done = _counter(progress, description, sum(s.turns for s in scripts))
    records: list[RequestRecord] = []

    async def user(s: ConversationScript) -> None:
        history: list[Any] = []
        for k in range(s.turns):
            req = turn_request(s, k, history, chat=chat)
            t = time.perf_counter()
            try:
                rec = await target.send(req)
            except asyncio.CancelledError:
                records.append(RequestRecord.failure(start=t, end=time.perf_counter(), error_code=ERROR_INTERRUPTED,
                                                     error="run interrupted", interrupted=True,
                                                     index=s.user * s.turns + k))
                raise
            rec.turn, rec.index = k, s.user * s.turns + k
            records.append(rec)
            on_done(rec)
            if not rec.success:
                return
            history = next_history(req, rec.output_text or "", chat=chat)
            if k + 1 < s.turns:
                await asyncio.sleep(s.think_s[k])

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(user(s)) for s in scripts]
    interrupted = False
    try:
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        interrupted = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
    return LoadResult(pattern=_pattern(scripts), records=sorted(records, key=lambda r: r.index),
                      duration_s=time.perf_counter() - t0, interrupted=interrupted)
