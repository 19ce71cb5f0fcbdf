"""Admission control: refuse work the server cannot start soon, quickly and before it costs anything.

The handler decides from two counters kept on the asyncio thread (no engine round trip): requests that
were admitted but not yet scheduled by the engine, and their prompt tokens. Past `max_waiting` or
`max_queued_tokens` the answer is 429 with `Retry-After`; a request whose prompt alone exceeds the token
bound could never be admitted and gets 400 instead. Under load (`degrade_waiting` waiting requests) the
server degrades: only requests of priority >= `degrade_min_priority` are admitted, so the important
classes keep their latency while the rest are shed early.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmopt.serve.errors import ApiError
from llmopt.serve.metrics import ServerMetrics


@dataclass
class Ticket:
    """One admitted HTTP request: its engine requests that have not started, with their queued tokens."""

    pending: dict[str, int] = field(default_factory=dict)
    counted: bool = True  # still counted in `waiting`


class AdmissionController:
    def __init__(self, metrics: ServerMetrics, *, max_waiting: int, max_queued_tokens: int, retry_after_s: int = 1,
                 degrade_waiting: int | None = None, degrade_min_priority: int = 1):
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.max_queued_tokens = max_queued_tokens
        self.retry_after_s = retry_after_s
        self.degrade_waiting = degrade_waiting
        self.degrade_min_priority = degrade_min_priority
        self.waiting = 0
        self.queued_tokens = 0

    @property
    def degraded(self) -> bool:
        return self.degrade_waiting is not None and self.waiting >= self.degrade_waiting

    def _reject(self, reason: str, message: str) -> ApiError:
        self.metrics.reject(reason)
        return ApiError(429, message, code=reason, headers={"Retry-After": str(self.retry_after_s)})

    def check_capacity(self, priority: int) -> None:
        """Before any work on the request (tokenizing included): is there room for one more?"""
        if self.waiting >= self.max_waiting:
            raise self._reject("queue_full", f"server busy: {self.waiting} requests are waiting; retry later")
        if self.degraded and priority < self.degrade_min_priority:
            raise self._reject("degraded", "server overloaded: only requests of priority >= "
                               f"{self.degrade_min_priority} are admitted now; retry later")

    def admit(self, tokens: dict[str, int], priority: int) -> Ticket:
        """Count the request in; `tokens` maps each of its engine request ids to its queued prompt tokens."""
        total = sum(tokens.values())
        if total > self.max_queued_tokens:
            self.metrics.reject("too_long")
            raise ApiError(400, f"the request's prompts total {total} tokens, more than this server ever "
                           f"queues ({self.max_queued_tokens}, --max-queued-tokens)", param="prompt",
                           code="context_length_exceeded")
        self.check_capacity(priority)  # tokenizing yielded to other handlers: check again
        if self.queued_tokens + total > self.max_queued_tokens:
            raise self._reject("queued_tokens", f"server busy: {self.queued_tokens} prompt tokens are queued; "
                               "retry later")
        self.waiting += 1
        self.queued_tokens += total
        self._update_gauge()
        return Ticket(dict(tokens))

    def started(self, ticket: Ticket, request_id: str) -> None:
        """The scheduler admitted an engine request (or it finished): it no longer waits."""
        n = ticket.pending.pop(request_id, None)
        if n is not None:
            self.queued_tokens -= n
        if not ticket.pending and ticket.counted:
            ticket.counted = False
            self.waiting -= 1
        self._update_gauge()

    def release(self, ticket: Ticket) -> None:
        for rid in list(ticket.pending):
            self.started(ticket, rid)
        if ticket.counted:
            ticket.counted = False
            self.waiting -= 1
            self._update_gauge()

    def _update_gauge(self) -> None:
        self.metrics.degraded.set(1 if self.degraded else 0)
