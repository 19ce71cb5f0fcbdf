"""LLMEngine: add_request / step / abort_request over the scheduler, block manager and model runner.

One engine core serves `serve`, `bench` and `eval`. `step()` runs one batch and returns a RequestOutput
for every request that produced text or finished, with incremental `delta_text` for streaming, and
reports a `StepStats` to every registered listener (Prometheus metrics, benchmarks, logs).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llmopt.engine.builder import build_engine
from llmopt.engine.config import EngineConfig
from llmopt.engine.detokenizer import init_offsets
from llmopt.engine.model_runner import ModelRunner
from llmopt.engine.output_processor import OutputProcessor
from llmopt.engine.outputs import RequestOutput
from llmopt.engine.request import Request, RequestError, check_request
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.sequence import Sequence, SequenceStatus
from llmopt.engine.spec_decode import SpeculativeConfig, ngram_propose, spec_eligible, verify
from llmopt.engine.stats import FinishedRequest, StepStats

__all__ = ["LLMEngine", "RequestError"]


@dataclass
class SpecCounters:
    """Cumulative speculative-decoding counts, named after vLLM's spec_decode_* metrics."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    disabled_requests: int = 0
    skipped_steps: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_pos = [0] * self.k

    def take(self) -> tuple[int, int, int]:
        """(drafts, draft tokens, accepted tokens) since the previous call: one step's share."""
        d0, t0, a0 = getattr(self, "_reported", (0, 0, 0))
        self._reported = (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)
        return self.num_drafts - d0, self.num_draft_tokens - t0, self.num_accepted_tokens - a0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verification step (accepted drafts + the target's own token)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        p = build_engine(config)
        self.resolved, self.spec, self.device, self.dtype = p.resolved, p.spec, p.device, p.dtype
        self.model, self.weights_dir, self.tokenizer = p.model, p.weights_dir, p.tokenizer
        self.eos_token_ids, self.structured_outputs = p.eos_token_ids, p.structured_outputs
        self.kv_cache, self.kv_cache_bytes, self.num_blocks = p.kv_cache, p.kv_cache_bytes, p.num_blocks
        self.max_model_len = p.max_model_len
        self.block_manager, self.scheduler, self.runner = p.block_manager, p.scheduler, p.runner
        self.draft_runner: ModelRunner | None = p.draft_runner
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.spec_config: SpeculativeConfig | None = config.speculative
        self.spec_enabled = self.spec_config is not None  # servers turn it off under load
        self.spec_counters = SpecCounters(
            (self.spec_config.max_speculative_tokens or self.spec_config.num_speculative_tokens) if self.spec_config else 0)
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []
        self._pending_finished: list[FinishedRequest] = []
        self.stat_listeners: list[Callable[[StepStats], None]] = []
        self._next_id = 0

    # ---- requests -----------------------------------------------------------
    def encode_prompt(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not messages:
            raise RequestError("messages must not be empty")
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # jinja errors for malformed messages
            raise RequestError(f"cannot apply the chat template: {e}") from None

    def add_request(self, request_id: str | None = None, prompt: str | None = None,
                    params: SamplingParams | None = None, prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    deadline: float | None = None) -> str:
        """Queue a request. Refuses (RequestError) what could never run: empty or too-long prompts."""
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if prompt is None:
                raise RequestError("a request needs a prompt or prompt_token_ids")
            prompt_token_ids = self.encode_prompt(prompt)
        ids = list(prompt_token_ids)
        check_request(ids, params, self.spec.vocab_size, self.max_model_len,
                      f"KV pool of {self.num_blocks} blocks × {self.config.block_size}", self.structured_outputs)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        seqs = []
        for i in range(params.n):
            seq = Sequence(request_id, i, ids, params, arrival, priority, tuple(self.eos_token_ids))
            if params.structured_outputs is not None:
                seq.grammar = self.structured_outputs.matcher(params.structured_outputs)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.device).manual_seed(params.seed + i)
            init_offsets(seq)
            seqs.append(seq)
        self.requests[request_id] = Request(request_id, prompt, ids, params, seqs, deadline,
                                             prompt_logprobs=None if params.prompt_logprobs is None
                                             else [None] * len(ids))
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        """Stop a request now and free its KV blocks. Returns False if it is unknown or already done."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, reason)
        self._pending.append(self.outputs.make_output(req))
        return True

    def get_request(self, request_id: str) -> Request | None:
        """The request still tracked under this id (None once its final output was returned)."""
        return self.requests.get(request_id)

    def set_priority(self, request_id: str, priority: int) -> bool:
        """Change a queued or running request's scheduling priority (lower runs first); the scheduler
        reads it from its next step. Returns False if the request is unknown or done."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        for seq in req.seqs:
            seq.priority = priority
        return True

    def reset_prefix_cache(self) -> None:
        """Drop every cached block no sequence holds (benchmarks compare cold runs)."""
        self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return sum(1 for r in self.requests.values() if not r.finished)

    def free_capacity(self) -> tuple[int, int]:
        """(sequence slots, KV blocks) free for sequences not scheduled yet, so a server can tell a request
        that starts at the next step from one that has to wait. A preempted sequence keeps its slot (it is
        queued to resume); evictable prefix-cache blocks count as free, as the scheduler counts them."""
        sched = self.scheduler
        held = len(sched.running) + sum(1 for s in sched.waiting if s.metrics.first_scheduled_time is not None)
        return max(0, sched.max_num_seqs - held), self.block_manager.num_free_blocks

    # ---- the step -----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self._expire_deadlines(t0)
        if self.spec_config is not None and self.spec_enabled:
            self._propose_drafts()
        sched = self.scheduler.schedule()
        if self.spec_config is not None:
            scheduled_ids = {s.seq_id for s, _ in sched.scheduled}
            for seq in self.scheduler.running:
                if seq.spec_tokens and seq.seq_id not in scheduled_ids:
                    seq.spec_tokens = []
            if self.spec_config.method in ("layer_skip", "draft"):
                self._run_draft(sched.scheduled)
        t1 = time.perf_counter()
        outputs = self._pending
        self._pending = []
        finished_stats, self._pending_finished = self._pending_finished, []
        new_tokens: list[tuple[str, float]] = []
        prepare = forward = sample = 0.0
        n_prefill = n_decode = 0
        if not sched.empty:
            res = self.runner.execute(sched.scheduled)
            prepare, forward, sample = res.prepare_time, res.forward_time, res.sample_time
            n_prefill, n_decode = res.num_prefill_tokens, res.num_decode_tokens
            for seq, n in sched.scheduled:
                if not seq.spec_tokens:
                    seq.num_computed_tokens += n
                    self.block_manager.commit_full_blocks(seq)
            for seq, start, entries in res.prompt_logprobs:  # any of the n sequences (each computes them all)
                self.requests[seq.request_id].prompt_logprobs[start:start + len(entries)] = entries
            now = time.perf_counter()
            touched: dict[str, Request] = {}
            for seq, token, lp in res.sampled:
                self._append_token(seq, token, lp, now)
                new_tokens.append((seq.request_id, now))
                touched[seq.request_id] = self.requests[seq.request_id]
            for seq, logits in res.spec_logits:
                for _ in range(self._accept_drafts(seq, logits, now)):
                    new_tokens.append((seq.request_id, now))
                touched[seq.request_id] = self.requests[seq.request_id]
            for req in touched.values():
                outputs.append(self.outputs.make_output(req))
        t2 = time.perf_counter()
        for req_out in outputs:
            if req_out.finished:
                self.requests.pop(req_out.request_id, None)
        finished_stats.extend(self._pending_finished)
        self._pending_finished = []
        self._report(sched, t0, t1, t2, prepare, forward, sample, n_prefill, n_decode, new_tokens,
                     finished_stats)
        return outputs

    def _propose_drafts(self) -> None:
        """Prompt-lookup drafts for running decodes, unless the batch is too large to profit."""
        spec = self.spec_config
        running = self.scheduler.running
        if len(running) > spec.max_batch_size:
            self.spec_counters.skipped_steps += 1
            return
        for seq in running:
            if (seq.spec_disabled or seq.num_computed_tokens != seq.num_tokens - 1 or not spec_eligible(seq.params)
                    or seq.params.logit_bias):  # verification draws from the unbiased distribution
                continue
            room = self.max_model_len - seq.num_tokens - 1
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
            k = min(self._draft_len(seq), room)
            if k <= 0:
                continue
            if spec.method == "ngram":
                seq.spec_tokens = ngram_propose(seq.token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max)
                if seq.grammar is not None:  # drop drafts the grammar refuses (they could only be rejected)
                    seq.spec_tokens = seq.spec_tokens[:seq.grammar.validate(seq.spec_tokens)]
            else:  # layer_skip / draft: reserve k slots now; the draft fills them after scheduling
                seq.spec_tokens = [0] * k

    def _draft_len(self, seq: Sequence) -> int:
        """This request's current k: its adapted draft length, or the configured one until it adapts."""
        return seq.spec_k or self.spec_config.num_speculative_tokens

    def _run_draft(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """Fill reserved draft slots with greedy tokens of the self-draft (`layer_skip`) or the separate
        draft model (`draft`), k passes batched across the speculating sequences."""
        seqs = [s for s, _ in scheduled if s.spec_tokens]
        if not seqs:
            return
        if self.spec_config.method == "layer_skip":
            runner, layers = self.runner, self.spec_config.draft_layers or max(1, self.spec.num_layers // 2)
        else:
            runner, layers = self.draft_runner, None
        for j in range(max(len(s.spec_tokens) for s in seqs)):
            active = [s for s in seqs if len(s.spec_tokens) > j]
            items = []
            for s in active:
                if j > 0:
                    items.append((s.block_table, s.num_tokens - 1 + j, [s.spec_tokens[j - 1]]))
                else:  # the separate draft first catches up on the tokens it has not cached
                    start = s.num_tokens - 1 if layers is not None else min(s.draft_computed, s.num_tokens - 1)
                    items.append((s.block_table, start, s.token_ids[start:]))
            for s, t in zip(active, runner.greedy_next(items, layers), strict=True):
                s.spec_tokens[j] = t
        if layers is None:
            for s in seqs:  # positions written: the context, then drafts 1..k-1
                s.draft_computed = s.num_tokens - 1 + len(s.spec_tokens)

    def _accept_drafts(self, seq: Sequence, logits: torch.Tensor, now: float) -> int:
        """Verify a speculating sequence's drafts; append what is accepted plus the target's token.
        Returns the number of tokens appended."""
        drafts = seq.spec_tokens
        seq.spec_tokens = []
        out = verify(logits, drafts, seq.params, seq.generator, seq.grammar)
        accepted = len(out) - 1
        c = self.spec_counters
        c.num_drafts += 1
        c.num_draft_tokens += len(drafts)
        c.num_accepted_tokens += accepted
        for i in range(accepted):
            c.accepted_per_pos[i] += 1
        seq.spec_proposed += len(drafts)
        seq.spec_accepted += accepted
        spec = self.spec_config
        if spec.max_speculative_tokens is not None and drafts:
            k = self._draft_len(seq)
            seq.spec_k = min(spec.max_speculative_tokens, k + 2) if accepted == len(drafts) else max(1, k - 1)
        if (seq.spec_proposed >= spec.disable_min_drafts
                and seq.spec_accepted < spec.min_acceptance * seq.spec_proposed):
            seq.spec_disabled = True
            c.disabled_requests += 1
        seq.num_computed_tokens += 1  # the last real token's K/V is now cached
        appended = 0
        for j, token in enumerate(out):
            self._append_token(seq, token, None, now)
            appended += 1
            if seq.is_finished:
                return appended
            if j < accepted:
                seq.num_computed_tokens += 1  # an accepted draft: its K/V was computed in this pass
        # the draft model's cache holds the accepted drafts; what follows is recomputed next round
        seq.draft_computed = min(seq.draft_computed, seq.num_computed_tokens)
        self.block_manager.commit_full_blocks(seq)
        return appended

    def _expire_deadlines(self, now: float) -> None:
        for req in list(self.requests.values()):
            if req.deadline is not None and not req.finished and now > req.deadline:
                self.abort_request(req.request_id, reason="timeout")

    def _append_token(self, seq: Sequence, token: int, lp, now: float) -> None:
        reason = self.outputs.append_token(seq, token, lp, now)
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.metrics.finished_time = time.perf_counter()
        req = self.requests[seq.request_id]
        if all(s.is_finished for s in req.seqs):
            req.finished = True
            for s in req.seqs:
                self._pending_finished.append(FinishedRequest(req.request_id, s.finish_reason or reason,
                                                              s.num_prompt_tokens, s.num_output_tokens,
                                                              s.metrics))

    def _report(self, sched, t0, t1, t2, prepare, forward, sample, n_prefill, n_decode, new_tokens,
                finished) -> None:
        if not self.stat_listeners:
            return
        bm, sched_ = self.block_manager, self.scheduler
        queries, hits = bm.take_prefix_counts()
        drafts, draft_tokens, accepted = self.spec_counters.take()
        stats = StepStats(
            now=t2, num_running=len(sched_.running), num_waiting=len(sched_.waiting),
            kv_cache_usage=bm.usage, prefix_cache_queries=queries, prefix_cache_hits=hits,
            num_preemptions=sched_.take_num_preemptions(), batch_size=len(sched.scheduled),
            num_prefill_tokens=n_prefill, num_decode_tokens=n_decode, schedule_time=t1 - t0,
            prepare_time=prepare, forward_time=forward, sample_time=sample,
            postprocess_time=max(0.0, (t2 - t1) - prepare - forward - sample), step_time=t2 - t0,
            spec_num_drafts=drafts, spec_num_draft_tokens=draft_tokens, spec_num_accepted_tokens=accepted,
            spec_enabled=self.spec_config is not None and self.spec_enabled,
            new_tokens=new_tokens, finished=finished)
        for listener in self.stat_listeners:
            listener(stats)

