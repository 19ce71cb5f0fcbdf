"""What the in-process engine counted during a run, in the same `ServerMetrics` shape as a server's `/metrics`.

Over HTTP we diff Prometheus counters before and after a run. Offline there is no scrape: the engine calls
every function in `engine.stat_listeners` with a `StepStats` after each step, and this collector sums the
per-step deltas (prefix-cache queries and hits, preemptions, speculative drafts and acceptances) between `reset()` and `server_metrics()`. The
report and the comparison table then treat both targets alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmopt.bench.http_target import ServerMetrics

if TYPE_CHECKING:
    from llmopt.engine.stats import StepStats


class StepStatsCollector:
    """A `stat_listeners` callback that accumulates one run's engine counters."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start a new run: everything counted so far (warm-up) is dropped."""
        self.steps = 0
        self.busy_steps = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.batched_seqs = 0
        self.kv_usage_peak = 0.0
        self.step_time_s = 0.0
        self.forward_time_s = 0.0
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted = 0

    def __call__(self, s: StepStats) -> None:
        self.steps += 1
        self.prefix_queries += s.prefix_cache_queries
        self.prefix_hits += s.prefix_cache_hits
        self.preemptions += s.num_preemptions
        self.prefill_tokens += s.num_prefill_tokens
        self.decode_tokens += s.num_decode_tokens
        self.kv_usage_peak = max(self.kv_usage_peak, s.kv_cache_usage)
        self.step_time_s += s.step_time
        self.forward_time_s += s.forward_time
        self.spec_drafts += s.spec_num_drafts
        self.spec_draft_tokens += s.spec_num_draft_tokens
        self.spec_accepted += s.spec_num_accepted_tokens
        if s.batch_size > 0:
            self.busy_steps += 1
            self.batched_seqs += s.batch_size

    def server_metrics(self) -> ServerMetrics:
        """The run's counters. The hit rate is None when no prompt token was looked up (caching off)."""
        return ServerMetrics(
            prefix_cache_hits=float(self.prefix_hits),
            prefix_cache_queries=float(self.prefix_queries),
            prefix_cache_hit_rate=self.prefix_hits / self.prefix_queries if self.prefix_queries else None,
            preemptions=float(self.preemptions),
            spec_decode_draft_tokens=float(self.spec_draft_tokens) if self.spec_drafts else None,
            spec_decode_accepted_tokens=float(self.spec_accepted) if self.spec_drafts else None,
            spec_decode_acceptance_rate=(self.spec_accepted / self.spec_draft_tokens
                                         if self.spec_draft_tokens else None),
            spec_decode_mean_acceptance_length=(1 + self.spec_accepted / self.spec_drafts
                                                if self.spec_drafts else None),
            kv_cache_usage_peak=self.kv_usage_peak,
            mean_batch_size=self.batched_seqs / self.busy_steps if self.busy_steps else None,
            counters={
                "steps": float(self.busy_steps),
                "prefill_tokens": float(self.prefill_tokens),
                "decode_tokens": float(self.decode_tokens),
                "step_time_s": self.step_time_s,
                "forward_time_s": self.forward_time_s,
            },
        )
