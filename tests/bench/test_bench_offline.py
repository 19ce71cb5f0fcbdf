"""The in-process target: client emulation (slots, arrivals, static batches), faults and engine counters."""

from __future__ import annotations

import pytest

from llmopt.bench.load import LoadPattern, arrival_schedule
from llmopt.bench.metrics import compute_metrics
from llmopt.bench.offline import OfflineEngineTarget
from llmopt.bench.workloads import BenchRequest, PrefixWorkload
from llmopt.errors import LlmoptError


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from llmopt.engine.config import EngineConfig
    from llmopt.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu", kv_cache_memory="16MiB",
                                  max_num_seqs=8))


@pytest.fixture
def target(engine):
    t = OfflineEngineTarget(engine)
    yield t
    t.close()
    assert not engine.has_unfinished_requests()


def _reqs(out_lens: list[int], prompt_len: int = 6) -> list[BenchRequest]:
    return [BenchRequest(prompt=[(7 * i + k) % 200 + 10 for k in range(prompt_len)], max_tokens=n,
                         expected_prompt_tokens=prompt_len) for i, n in enumerate(out_lens)]


def test_concurrency_slots_hand_over_at_the_last_token(target):
    out_lens = [3, 9, 5, 2, 8, 4, 6, 3, 7, 2]
    res, _ = target.run(_reqs(out_lens), LoadPattern(concurrency=3))
    recs = res.records
    assert [r.index for r in recs] == list(range(10)) and all(r.success for r in recs)
    assert [r.output_tokens for r in recs] == out_lens  # ignore_eos: exactly max_tokens each
    assert all(r.prompt_tokens == 6 and len(r.token_times) == r.output_tokens for r in recs)
    assert len({r.start for r in recs[:3]}) == 1  # the first three take the three free slots at once
    ends = {r.end for r in recs}
    assert all(r.start in ends for r in recs[3:])  # every later request starts when a slot's owner ended
    assert compute_metrics(recs, res.duration_s).peak_concurrency == 3
    assert all(r.ttft > 0 and r.first_token >= r.start for r in recs)


def test_request_rate_arrivals_follow_the_schedule(target):
    pattern = LoadPattern(request_rate=400.0, seed=3)
    res, _ = target.run(_reqs([2] * 8), pattern)
    offsets = arrival_schedule(8, 400.0, seed=3)
    starts = [r.start for r in res.records]
    for i in range(8):  # arrival times are the schedule's, whatever step boundary they were added at
        assert starts[i] - starts[0] == pytest.approx(offsets[i] - offsets[0], abs=1e-9)
    assert res.duration_s >= offsets[-1]


def test_static_batches_wait_for_their_longest_request(target):
    out_lens = [2, 12, 3, 4, 9, 2, 2, 3, 5, 6]
    res, counters = target.run(_reqs(out_lens), LoadPattern(concurrency=4), batching="static")
    recs = res.records
    batches = [recs[0:4], recs[4:8], recs[8:10]]
    for b in batches:
        assert len({r.start for r in b}) == 1
    for prev, nxt in zip(batches, batches[1:], strict=False):
        assert nxt[0].start == max(r.end for r in prev)  # admitted only when the whole batch finished
    assert compute_metrics(recs, res.duration_s).peak_concurrency <= 4
    assert counters.mean_batch_size is not None and counters.mean_batch_size <= 4


def test_static_batching_needs_a_batch_that_fits(target):
    with pytest.raises(LlmoptError, match="exceeds the engine's max_num_seqs 8"):
        target.run(_reqs([2]), LoadPattern(concurrency=16), batching="static")
    with pytest.raises(LlmoptError, match="no request rate"):
        target.run(_reqs([2]), LoadPattern(concurrency=2, request_rate=5.0), batching="static")


def test_refused_requests_are_counted_not_raised(target, engine):
    reqs = _reqs([2, 2, 2])
    reqs[1] = BenchRequest(prompt=[5] * (engine.max_model_len + 5), max_tokens=2)
    res, _ = target.run(reqs, LoadPattern(concurrency=2))
    assert [r.success for r in res.records] == [True, False, True]
    assert res.records[1].error_code == "rejected" and "tokens" in (res.records[1].error or "")


def test_engine_failure_fails_in_flight_requests_and_the_run_goes_on(target, engine, monkeypatch):
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(scheduled):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("CUDA error: device-side assert")
        return real(scheduled)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    res, _ = target.run(_reqs([4] * 6), LoadPattern(concurrency=2))
    codes = [r.error_code for r in res.records]
    assert len(res.records) == 6 and not res.interrupted
    assert codes.count("exception:RuntimeError") == 2  # the two in flight at the failing step
    assert sum(r.success for r in res.records) == 4


def test_ctrl_c_returns_partial_results(target, engine):
    steps = {"n": 0}

    def interrupt(_stats):
        steps["n"] += 1
        if steps["n"] == 6:
            raise KeyboardInterrupt

    engine.stat_listeners.append(interrupt)
    try:
        res, _ = target.run(_reqs([3] * 10), LoadPattern(concurrency=2))
    finally:
        engine.stat_listeners.remove(interrupt)
    assert res.interrupted
    done = [r for r in res.records if r.success]
    cut = [r for r in res.records if r.interrupted]
    assert done and cut and len(res.records) < 10
    assert all(r.error_code == "interrupted" for r in cut)
    engine.step()  # the engine drains the aborted requests and is usable again


def test_prefix_hits_are_counted_per_run_from_a_cold_cache(target, engine):
    # prefixes of 4 full blocks; concurrency 1 so each request sees the blocks the previous ones left
    wl = PrefixWorkload(num_requests=6, num_prefixes=2, prefix_len=64, suffix_len="5", output_len="2",
                        token_ids=True)
    reqs = wl.build(engine.tokenizer)
    res, counters = target.run(reqs, LoadPattern(concurrency=1), warmup=1)
    assert all(r.success for r in res.records)
    queries = sum(r.prompt_tokens for r in res.records)
    assert counters.prefix_cache_queries == queries
    assert counters.prefix_cache_hits == (6 - 2) * 64  # warm-up hits were dropped and the cache emptied
    assert counters.prefix_cache_hit_rate == pytest.approx(4 * 64 / queries)
    assert counters.preemptions == 0 and counters.kv_cache_usage_peak > 0
