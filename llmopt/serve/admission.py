"""Admission control: refuse work the server cannot start soon, quickly and before it costs anything.

The handler decides from counters kept on the asyncio thread (no engine round trip). A request that can
start at once is not waiting: the engine thread publishes its free capacity (sequence slots, KV blocks)
with each step's events, and admitted requests not yet scheduled fill it in arrival order. Those that
fit are `starting`; only the rest are `waiting` and count, with their prompt tokens, against
`max_waiting` and `max_queued_tokens`. Past either bound the answer is 429 with `Retry-After`; a
request whose prompt alone exceeds the token bound could never be admitted and gets 400 instead. Under
load (`degrade_waiting` waiting requests) the server degrades: only requests of priority >=
`degrade_min_priority` are admitted, so the important classes keep their latency while the rest are
shed early.

The starting requests form a prefix of the unscheduled ones in arrival order, like the scheduler's own
head-of-line rule: once one request waits, every later one waits too. That keeps `check_capacity`, which
runs before the prompt is tokenized, exact: with anyone waiting, a new request would wait as well.
A request's need is an upper bound (prefix-cache hits and chunked prefill take fewer blocks), so the
rule errs towards waiting, never towards admitting more than the engine can start.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from llmopt.serve.errors import ApiError
from llmopt.serve.metrics import ServerMetrics


class Need(NamedTuple):
    """What an unscheduled engine request takes when it starts: prompt tokens, sequences, KV blocks (× n)."""

    tokens: int
    seqs: int
    blocks: int


@dataclass(eq=False)  # tickets are told apart by identity
class Ticket:
    """One admitted HTTP request: its engine requests that have not started, with what each needs."""

    pending: dict[str, Need] = field(default_factory=dict)
    line: _Line | None = None  # the line it stands in until all its engine requests started

    @property
    def need(self) -> Need:
        v = self.pending.values()
        return Need(sum(x.tokens for x in v), sum(x.seqs for x in v), sum(x.blocks for x in v))


class _Line:
    """Tickets in arrival order, with the sum of what their pending engine requests need."""

    def __init__(self) -> None:
        self.tickets: OrderedDict[Ticket, None] = OrderedDict()
        self.tokens = self.seqs = self.blocks = 0

    def __len__(self) -> int:
        return len(self.tickets)

    def count(self, need: Need, sign: int) -> None:
        self.tokens += sign * need.tokens
        self.seqs += sign * need.seqs
        self.blocks += sign * need.blocks

    def add(self, t: Ticket, front: bool = False) -> None:
        self.tickets[t] = None
        if front:
            self.tickets.move_to_end(t, last=False)
        t.line = self
        self.count(t.need, 1)

    def remove(self, t: Ticket) -> None:
        del self.tickets[t]
        t.line = None
        self.count(t.need, -1)

    def first(self) -> Ticket:
        return next(iter(self.tickets))

    def last(self) -> Ticket:
        return next(reversed(self.tickets))


class AdmissionController:
    def __init__(self, metrics: ServerMetrics, *, max_waiting: int, max_queued_tokens: int, retry_after_s: int = 1,
                 degrade_waiting: int | None = None, degrade_min_priority: int = 1, block_size: int = 16):
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.max_queued_tokens = max_queued_tokens
        self.retry_after_s = retry_after_s
        self.degrade_waiting = degrade_waiting
        self.degrade_min_priority = degrade_min_priority
        self.block_size = block_size
        # the engine's free (sequence slots, KV blocks) as of its last reported step; none until it reports
        self.free_seqs = 0
        self.free_blocks = 0
        self._starting = _Line()  # unscheduled, but within the free capacity: they start at the next step
        self._waiting = _Line()  # unscheduled beyond it
        # plain ints, rewritten after every change: the engine thread reads `degraded` too
        self.waiting = 0
        self.queued_tokens = 0

    @property
    def starting(self) -> int:
        """Admitted requests not scheduled yet that fit the engine's free capacity (not waiting)."""
        return len(self._starting)

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

    def admit(self, prompt_lens: dict[str, int], n: int, priority: int) -> Ticket:
        """Count the request in; `prompt_lens` maps each of its engine request ids to its prompt length,
        and each engine request runs `n` sequences."""
        bs = self.block_size
        needs = {rid: Need(length * n, n, n * -(-length // bs)) for rid, length in prompt_lens.items()}
        ticket = Ticket(needs)
        total = ticket.need.tokens
        if total > self.max_queued_tokens:
            self.metrics.reject("too_long")
            raise ApiError(400, f"the request's prompts total {total} tokens, more than this server ever "
                           f"queues ({self.max_queued_tokens}, --max-queued-tokens)", param="prompt",
                           code="context_length_exceeded")
        self.check_capacity(priority)  # tokenizing yielded to other handlers: check again
        if not self._fits(ticket.need) and self.queued_tokens + total > self.max_queued_tokens:
            raise self._reject("queued_tokens", f"server busy: {self.queued_tokens} prompt tokens are queued; "
                               "retry later")
        self._waiting.add(ticket)
        self._rebalance()
        return ticket

    def set_capacity(self, free_seqs: int, free_blocks: int) -> None:
        """The engine's free capacity after a step (called on the asyncio thread, after that step's events)."""
        self.free_seqs = free_seqs
        self.free_blocks = free_blocks
        self._rebalance()

    def started(self, ticket: Ticket, request_id: str) -> None:
        """The scheduler admitted an engine request (or it finished): it no longer waits."""
        need = ticket.pending.pop(request_id, None)
        line = ticket.line
        if line is None:
            return
        if need is not None:
            line.count(need, -1)  # the ticket keeps its place for its other engine requests
        if not ticket.pending:
            line.remove(ticket)
        self._rebalance()

    def release(self, ticket: Ticket) -> None:
        """The HTTP request is over (done, failed, client gone): nothing of it is counted any more."""
        if ticket.line is not None:
            ticket.line.remove(ticket)
        ticket.pending.clear()
        self._rebalance()

    def _fits(self, need: Need) -> bool:
        """Would a new request with this need start at once? Only if nobody waits ahead of it."""
        s = self._starting
        return (not self._waiting and s.seqs + need.seqs <= self.free_seqs
                and s.blocks + need.blocks <= self.free_blocks)

    def _rebalance(self) -> None:
        """Keep `starting` the longest arrival-order prefix of the unscheduled requests that fits."""
        s, w = self._starting, self._waiting
        while s and (s.seqs > self.free_seqs or s.blocks > self.free_blocks):
            t = s.last()
            s.remove(t)
            w.add(t, front=True)
        while w:
            t = w.first()
            need = t.need
            if s.seqs + need.seqs > self.free_seqs or s.blocks + need.blocks > self.free_blocks:
                break
            w.remove(t)
            s.add(t)
        self.waiting = len(w)
        self.queued_tokens = w.tokens
        self.metrics.degraded.set(1 if self.degraded else 0)
