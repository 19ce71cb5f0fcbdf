"""One request's raw timings: the single currency between load generation and metric computation.

Every target (the HTTP client, the in-process engine) turns a request into a `RequestRecord` and nothing
else, so TTFT/TPOT/ITL are defined once, in `metrics.py`, and can never drift between targets.

Times are seconds on the monotonic `time.perf_counter()` clock. Absolute values mean nothing; only
differences within one process do, which is all a benchmark needs (and wall clocks can jump).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import pairwise

from pydantic import BaseModel, Field, model_validator

ERROR_INTERRUPTED = "interrupted"
"""Error code of a request that was in flight when the run was cancelled (Ctrl-C)."""


class RequestRecord(BaseModel):
    """What happened to one request, as observed by the client.

    A streamed chunk may carry more than one token (servers batch detokenized text, speculative decoding
    accepts several tokens per step), so arrival times are per *chunk*, with `chunk_token_counts`
    alongside. ITL is therefore a per-chunk gap, exactly like vLLM's streaming ITL, while TPOT divides
    by the true token count.
    """

    index: int = Field(-1, description="Position of the request in the workload; set by the runner.")
    start: float = Field(description="When the request was sent (perf_counter seconds).")
    first_token: float | None = Field(None, description="Arrival of the first token-bearing chunk.")
    token_times: list[float] = Field(default_factory=list, description="Arrival of each token-bearing chunk.")
    chunk_token_counts: list[int] = Field(
        default_factory=list, description="Tokens carried by each chunk in `token_times` (1 when unknown)."
    )
    end: float = Field(description="Arrival of the last token (success) or the time of failure.")
    prompt_tokens: int = Field(0, description="Prompt length: the server's usage block, else our estimate.")
    output_tokens: int = Field(0, description="Generated tokens: the server's usage block, else summed chunks.")
    success: bool = True
    error_code: str | None = Field(None, description="Short machine-friendly cause: http_500, timeout, ...")
    error: str | None = Field(None, description="Human-readable detail of the failure.")
    interrupted: bool = Field(False, description="In flight when the run was cancelled; neither ok nor failed.")
    slo_met: bool | None = Field(None, description="Set by `metrics.apply_slo`; None when no SLO was given.")
    turn: int | None = Field(None, description="Conversations: the turn (0-based) this request was.")
    output_text: str | None = Field(None, description="Conversations over HTTP: the answer, for the next turn.")

    @model_validator(mode="after")
    def _consistent(self) -> RequestRecord:
        if self.token_times and not self.chunk_token_counts:
            self.chunk_token_counts = [1] * len(self.token_times)
        if len(self.chunk_token_counts) != len(self.token_times):
            raise ValueError("chunk_token_counts must have one entry per token_times entry")
        if self.first_token is None and self.token_times:
            self.first_token = self.token_times[0]
        return self

    @property
    def ttft(self) -> float | None:
        """Seconds from send to the first token, or None if no token arrived."""
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2el(self) -> float:
        """End-to-end latency in seconds: send to last token."""
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token excluding the first (vLLM): (e2el - ttft) / (output_tokens - 1).

        None for requests with at most one output token, which have no decode phase to time.
        """
        ttft = self.ttft
        if ttft is None or self.output_tokens <= 1:
            return None
        return (self.e2el - ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive chunk arrivals (seconds)."""
        return [b - a for a, b in pairwise(self.token_times)]

    @classmethod
    def failure(
        cls,
        *,
        start: float,
        end: float,
        error_code: str,
        error: str,
        prompt_tokens: int = 0,
        index: int = -1,
        interrupted: bool = False,
    ) -> RequestRecord:
        """A request that produced no usable result (or was cut short by cancellation)."""
        return cls(
            index=index,
            start=start,
            end=end,
            prompt_tokens=prompt_tokens,
            success=False,
            error_code=error_code,
            error=error,
            interrupted=interrupted,
        )

    @classmethod
    def from_chunks(
        cls,
        *,
        start: float,
        token_times: list[float],
        chunk_token_counts: list[int] | None = None,
        prompt_tokens: int = 0,
        output_tokens: int | None = None,
        index: int = -1,
    ) -> RequestRecord:
        """A successful request from its chunk arrival times.

        `end` is the last chunk's arrival (vLLM's latency), `output_tokens` defaults to the chunk token sum.
        """
        if not token_times:
            raise ValueError("a successful request needs at least one token chunk")
        counts = list(chunk_token_counts) if chunk_token_counts is not None else [1] * len(token_times)
        if len(counts) != len(token_times):
            raise ValueError("chunk_token_counts must have one entry per token chunk")
        return cls(
            index=index,
            start=start,
            first_token=token_times[0],
            token_times=list(token_times),
            chunk_token_counts=counts,
            end=token_times[-1],
            prompt_tokens=prompt_tokens,
            output_tokens=sum(counts) if output_tokens is None else output_tokens,
        )


class RecordTimer:
    """Builds a `RequestRecord` while a response streams in, for targets that see tokens directly.

    The in-process engine's adapter calls `chunk(n)` each time new tokens come out, then `success()` or
    `failure()`. Start, chunk and end times all come from the same clock, read at the moment of the call.
    """

    def __init__(self, *, prompt_tokens: int = 0, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.prompt_tokens = prompt_tokens
        self.start = clock()
        self.times: list[float] = []
        self.counts: list[int] = []

    def chunk(self, n_tokens: int = 1) -> None:
        """Record the arrival of `n_tokens` new tokens now (0-token chunks are ignored)."""
        if n_tokens > 0:
            self.times.append(self.clock())
            self.counts.append(n_tokens)

    def success(self, *, prompt_tokens: int | None = None, output_tokens: int | None = None) -> RequestRecord:
        """The finished record; with no token seen it is a failure (`no_tokens`), as over HTTP."""
        prompt = self.prompt_tokens if prompt_tokens is None else prompt_tokens
        if not self.times:
            return self.failure("no_tokens", "the request finished without any generated token",
                                prompt_tokens=prompt)
        return RequestRecord.from_chunks(start=self.start, token_times=self.times,
                                         chunk_token_counts=self.counts, prompt_tokens=prompt,
                                         output_tokens=output_tokens)

    def failure(self, error_code: str, error: str, *, prompt_tokens: int | None = None) -> RequestRecord:
        return RequestRecord.failure(start=self.start, end=self.clock(), error_code=error_code, error=error,
                                     prompt_tokens=self.prompt_tokens if prompt_tokens is None else prompt_tokens)
