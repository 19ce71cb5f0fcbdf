"""Request outputs and per-request timing, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter-based monotonic seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "timeout"
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob} top-n + chosen
    delta_text: str = ""  # text added since the previous output of this request (streaming)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token {token id: (logprob, rank)} (the token itself and the
    # top-n), None for the first token; complete once the prefill is (the list is filled as chunks run)
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None
