"""What the engine reports after every step, for /metrics, bench and logs (vLLM-style quantities)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmopt.engine.outputs import RequestMetrics


@dataclass
class FinishedRequest:
    request_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    metrics: RequestMetrics


@dataclass
class StepStats:
    now: float
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1, evictable prefix-cache blocks count as free
    prefix_cache_queries: int  # tokens looked up this step
    prefix_cache_hits: int  # tokens found this step
    num_preemptions: int  # this step
    batch_size: int  # sequences in the step
    num_prefill_tokens: int
    num_decode_tokens: int
    schedule_time: float
    prepare_time: float
    forward_time: float
    sample_time: float
    postprocess_time: float
    step_time: float
    spec_num_drafts: int = 0  # verification steps of speculating sequences (this step)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_enabled: bool = False
    new_tokens: list[tuple[str, float]] = field(default_factory=list)  # (request_id, time) per token
    finished: list[FinishedRequest] = field(default_factory=list)

    @property
    def overhead_time(self) -> float:
        """CPU-side scheduling and bookkeeping: everything but the forward pass and sampling."""
        return self.schedule_time + self.prepare_time + self.postprocess_time
