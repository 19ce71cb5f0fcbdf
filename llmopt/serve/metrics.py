"""Prometheus metrics under vLLM's names with our prefix (`llmopt:`), in a registry of the server's own.

Engine quantities come from the `StepStats` each step reports (called on the engine thread; the
prometheus_client types are thread-safe); admission rejections are counted by the HTTP handlers. Counters
get prometheus_client's `_total` suffix on the wire, as vLLM's do. Every series carries `model_name`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from llmopt.engine.stats import StepStats

# vLLM's buckets, so dashboards built for vLLM read ours unchanged
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "timeout")
REJECT_REASONS = ("queue_full", "queued_tokens", "degraded", "too_long", "not_ready", "shutting_down")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]
        m = model_name

        def hist(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(m)

        def gauge(name: str, doc: str):
            return Gauge(name, doc, lab, registry=r).labels(m)

        def counter(name: str, doc: str):
            return Counter(name, doc, lab, registry=r).labels(m)

        self.ttft = hist("llmopt:time_to_first_token_seconds", "Time to first token (arrival to first token).",
                         TTFT_BUCKETS)
        self.itl = hist("llmopt:inter_token_latency_seconds", "Time between consecutive output tokens.",
                        ITL_BUCKETS)
        self.e2e = hist("llmopt:e2e_request_latency_seconds", "Arrival to finish, per completion.", E2E_BUCKETS)
        self.queue_time = hist("llmopt:request_queue_time_seconds", "Arrival to first scheduled.", E2E_BUCKETS)
        self.running = gauge("llmopt:num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("llmopt:num_requests_waiting", "Sequences waiting in the engine's queue.")
        self.kv_usage = gauge("llmopt:kv_cache_usage_perc", "KV-cache pool usage, 0..1 (1 = full).")
        self.degraded = gauge("llmopt:degraded", "1 while low-priority admission is capped under load.")
        self.prefix_queries = counter("llmopt:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("llmopt:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("llmopt:num_preemptions", "Sequences preempted (recomputed later).")
        self.prompt_tokens = counter("llmopt:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("llmopt:generation_tokens", "Generated tokens.")
        self.spec_drafts = counter("llmopt:spec_decode_num_drafts", "Speculative verification steps.")
        self.spec_draft_tokens = counter("llmopt:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted = counter("llmopt:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_enabled = gauge("llmopt:spec_decode_enabled", "1 while speculative decoding is on.")
        self._success = Counter("llmopt:request_success", "Finished requests by finish reason.",
                                lab + ["finished_reason"], registry=r)
        self._rejected = Counter("llmopt:request_rejected", "Requests refused at admission, by reason.",
                                 lab + ["reason"], registry=r)
        self._cache_hits = Counter("llmopt:semantic_cache_hits", "Requests answered from the semantic cache.",
                                   lab + ["match"], registry=r)
        self._model = m
        for reason in FINISH_REASONS:
            self._success.labels(m, reason)
        for reason in REJECT_REASONS:
            self._rejected.labels(m, reason)
        for match in ("exact", "similar"):
            self._cache_hits.labels(m, match)

    def reject(self, reason: str) -> None:
        self._rejected.labels(self._model, reason).inc()

    def cache_hit(self, match: str) -> None:
        self._cache_hits.labels(self._model, match).inc()

    def on_step(self, s: StepStats) -> None:
        """StepStats listener (engine thread)."""
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_cache_usage)
        if s.prefix_cache_queries:
            self.prefix_queries.inc(s.prefix_cache_queries)
        if s.prefix_cache_hits:
            self.prefix_hits.inc(s.prefix_cache_hits)
        if s.num_preemptions:
            self.preemptions.inc(s.num_preemptions)
        if s.new_tokens:
            self.generation_tokens.inc(len(s.new_tokens))
        self.spec_enabled.set(1 if s.spec_enabled else 0)
        if s.spec_num_drafts:
            self.spec_drafts.inc(s.spec_num_drafts)
            self.spec_draft_tokens.inc(s.spec_num_draft_tokens)
            self.spec_accepted.inc(s.spec_num_accepted_tokens)
        seen: set[str] = set()
        for f in s.finished:  # one entry per completion; all of a request's arrive in the same step
            mt = f.metrics
            if f.request_id not in seen:
                seen.add(f.request_id)
                self._success.labels(self._model, f.finish_reason).inc()
                self.prompt_tokens.inc(f.num_prompt_tokens)
            if mt.first_token_time is not None:
                self.ttft.observe(max(0.0, mt.first_token_time - mt.arrival_time))
            if mt.first_scheduled_time is not None:
                self.queue_time.observe(max(0.0, mt.first_scheduled_time - mt.arrival_time))
            if mt.finished_time is not None:
                self.e2e.observe(max(0.0, mt.finished_time - mt.arrival_time))
            times = mt.token_times
            for a, b in zip(times, times[1:], strict=False):
                self.itl.observe(b - a)

    def render(self) -> bytes:
        return generate_latest(self.registry)
