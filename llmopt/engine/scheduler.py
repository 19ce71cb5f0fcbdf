"""Scheduler: continuous batching under a token budget, with chunked prefill and preemption (vLLM v1).

Running sequences go first, in policy order, each asking for the tokens it lacks (and its drafts),
within the step's budget. When the pool runs out, the last in order is preempted by recompute (its
blocks stay in the prefix cache). Waiting sequences are admitted only in steps without preemption.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from llmopt.engine.block_manager import BlockManager
from llmopt.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs"):
        """`policy`: "fcfs" or "priority" (EngineConfig.scheduling_policy, validated there)."""
        self.bm, self.policy, self.enable_chunked_prefill = block_manager, policy, enable_chunked_prefill
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = self._reported_preemptions = 0

    def _key(self, seq: Sequence) -> tuple[int, int]:
        """Policy order: arrival (fcfs; sequence ids count up), or priority first (lower runs first)."""
        return (seq.priority if self.policy == "priority" else 0, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from the queues and free its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)

    def take_num_preemptions(self) -> int:
        """Preemptions since the previous call: one step's share, for StepStats."""
        n = self.num_preemptions - self._reported_preemptions
        self._reported_preemptions = self.num_preemptions
        return n

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.spec.tokens = []
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, seq)
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=self._key)
        queue = list(self.running)  # victims are taken from the end
        i = 0
        while i < len(queue) and budget > 0:
            seq = queue[i]
            missing = seq.num_tokens - seq.num_computed_tokens
            drafts = seq.spec.tokens
            num_new = min(missing + len(drafts), budget)
            if drafts and num_new < missing + len(drafts):
                seq.spec.tokens = drafts[:max(0, num_new - missing)]  # drafts trimmed to the budget
            if num_new <= 0:
                i += 1
                continue
            while not self.bm.can_append(seq, num_new):
                victim = queue.pop()
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self.bm.append(seq, num_new)
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1
                continue
            # `seq` itself was preempted; everything after it is already gone from `queue`
            break
        if not out.preempted:
            self._admit(out, budget)
        out.num_batched_tokens = sum(n for _, n in out.scheduled)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        now = time.perf_counter()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = min(self.waiting, key=self._key)
            hits = self.bm.lookup_prefix(seq)
            num_cached = len(hits) * self.bm.block_size
            num_new = seq.num_tokens - num_cached
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.bm.can_allocate(hits, num_cached + num_new):
                break
            self.bm.count_prefix_lookup(seq, hits)
            self.waiting.remove(seq)
            self.bm.allocate(seq, hits, num_cached + num_new)
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
