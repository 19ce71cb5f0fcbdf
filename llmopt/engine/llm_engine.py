"""LLMEngine: add_request / step / abort_request, the one engine core under serve, bench and eval.

The step, one way: scheduler.py -> model input (model_runner.prepare, model_input.py) -> model ->
sampler.py / spec_decode/verifier.py -> post-step update (`_update`, the one writer of sequence
progress) -> outputs (output_processor.py), then the next step's drafts (spec_decode/speculator.py,
proposed after sampling as in vLLM v1). builder.py makes the parts; every step's `StepStats` goes to
the registered listeners (metrics, bench).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from llmopt.engine.builder import build_engine
from llmopt.engine.config import EngineConfig
from llmopt.engine.model_runner import ModelRunner, StepResult
from llmopt.engine.output_processor import OutputProcessor
from llmopt.engine.outputs import RequestOutput
from llmopt.engine.request import Request, RequestError, check_request, make_sequences
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.scheduler import SchedulerOutput
from llmopt.engine.sequence import Sequence, SequenceStatus
from llmopt.engine.spec_decode import SpeculativeConfig
from llmopt.engine.spec_decode.speculator import Speculator
from llmopt.engine.spec_decode.state import SpecCounters
from llmopt.engine.stats import FinishedRequest, StepStats

__all__ = ["LLMEngine", "RequestError"]


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
        self.threads = p.threads  # CPU threads; `auto` follows the cores other processes leave free
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.spec_config: SpeculativeConfig | None = config.speculative
        self.spec_enabled = self.spec_config is not None  # servers turn it off under load
        self.speculator = None if self.spec_config is None else Speculator(
            self.spec_config, self.runner, self.draft_runner, self.spec.num_layers, self.max_model_len,
            self.block_manager)
        self.spec_counters = self.speculator.counters if self.speculator else SpecCounters(0)
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []
        self._pending_finished: list[FinishedRequest] = []
        self.stat_listeners: list[Callable[[StepStats], None]] = []
        self._next_id = 0

    @property
    def decode_step_kind(self) -> str:
        """How decode steps run: "native" (one call per step, llmopt.step) or "eager" (layer by layer)."""
        return "native" if self.runner.decode_step is not None else "eager"

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
        seqs = make_sequences(request_id, ids, params, arrival, priority, self.eos_token_ids, self.structured_outputs,
                              self.device)
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
        """Change a request's scheduling priority (lower runs first) from the next step on; False if the
        request is unknown or done."""
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

    def free_capacity(self) -> tuple[int, int]:
        """(sequence slots, KV blocks) free for new sequences, so a server can tell a request that starts
        next step from one that waits. A preempted sequence keeps its slot; evictable blocks count as free."""
        sched = self.scheduler
        held = len(sched.running) + sum(1 for s in sched.waiting if s.metrics.first_scheduled_time is not None)
        return max(0, sched.max_num_seqs - held), self.block_manager.num_free_blocks

    def step(self) -> list[RequestOutput]:
        self.threads.tick()
        t0 = time.perf_counter()
        self._expire_deadlines(t0)
        spec = self.speculator
        if spec is not None and not self.spec_enabled:
            spec.discard(self.scheduler.running)
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        outputs, self._pending = self._pending, []
        new_tokens: list[tuple[str, float]] = []
        res = None
        if not sched.empty:
            res = self.runner.execute(sched.scheduled)
            outputs.extend(self._update(sched, res, new_tokens))
            if spec is not None and self.spec_enabled:
                spec.propose(self.scheduler.running)  # drafts for the next step
        t2 = time.perf_counter()
        for req_out in outputs:
            if req_out.finished:
                self.requests.pop(req_out.request_id, None)
        finished_stats, self._pending_finished = self._pending_finished, []  # aborted earlier, or this step
        if self.stat_listeners:
            self._report(sched, res, t0, t1, t2, new_tokens, finished_stats)
        return outputs

    def _update(self, sched: SchedulerOutput, res: StepResult, new_tokens: list[tuple[str, float]]
                ) -> list[RequestOutput]:
        """The one writer of sequence progress: num_computed_tokens, appended tokens, full blocks to the
        prefix cache, blocks out of a window given back. Returns the touched requests' outputs."""
        bm = self.block_manager
        for seq, n in sched.scheduled:
            if not seq.spec.tokens:  # a speculating sequence advances by what the verifier accepted
                seq.num_computed_tokens += n
                bm.record_progress(seq)  # full blocks to the prefix cache, blocks out of a window back
                seq.spec.draft_computed = min(seq.spec.draft_computed, seq.num_computed_tokens)  # drafts trimmed
        for seq, start, entries in res.prompt_logprobs:  # any of the n sequences (each computes them all)
            self.requests[seq.request_id].prompt_logprobs[start:start + len(entries)] = entries
        now = time.perf_counter()
        touched: dict[str, Request] = {}
        for seq, tokens, lps in res.new_tokens:
            speculated = bool(seq.spec.tokens)
            if speculated:
                self.speculator.record(seq, len(tokens) - 1)
                seq.num_computed_tokens += 1  # the last real token's K/V is now cached
            for j, (token, lp) in enumerate(zip(tokens, lps, strict=True)):
                reason = self.outputs.append_token(seq, token, lp, now)
                new_tokens.append((seq.request_id, now))
                if reason is not None:
                    self._finish(seq, reason)
                    break
                if j < len(tokens) - 1:
                    seq.num_computed_tokens += 1  # an accepted draft: its K/V was computed in this pass
            else:
                if speculated:
                    # the draft model's cache holds the accepted drafts; what follows is recomputed next round
                    seq.spec.draft_computed = min(seq.spec.draft_computed, seq.num_computed_tokens)
                    bm.record_progress(seq)
            touched[seq.request_id] = self.requests[seq.request_id]
        return [self.outputs.make_output(req) for req in touched.values()]

    def _expire_deadlines(self, now: float) -> None:
        for req in list(self.requests.values()):
            if req.deadline is not None and not req.finished and now > req.deadline:
                self.abort_request(req.request_id, reason="timeout")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.metrics.finished_time = time.perf_counter()
        req = self.requests[seq.request_id]
        if all(s.is_finished for s in req.seqs):
            req.finished = True
            self._pending_finished += [FinishedRequest(req.request_id, s.finish_reason or reason,
                                                       s.num_prompt_tokens, s.num_output_tokens, s.metrics)
                                       for s in req.seqs]

    def _report(self, sched: SchedulerOutput, res: StepResult | None, t0: float, t1: float, t2: float,
                new_tokens: list[tuple[str, float]], finished: list[FinishedRequest]) -> None:
        bm, sc = self.block_manager, self.scheduler
        queries, hits = bm.take_prefix_counts()
        drafts, draft_tokens, accepted = self.spec_counters.take()
        prepare, forward, sample = (res.prepare_time, res.forward_time, res.sample_time) if res else (0.0, 0.0, 0.0)
        stats = StepStats(
            now=t2, num_running=len(sc.running), num_waiting=len(sc.waiting),
            kv_cache_usage=bm.usage, prefix_cache_queries=queries, prefix_cache_hits=hits,
            num_preemptions=sc.take_num_preemptions(), batch_size=len(sched.scheduled),
            num_prefill_tokens=res.num_prefill_tokens if res else 0,
            num_decode_tokens=res.num_decode_tokens if res else 0, schedule_time=t1 - t0,
            prepare_time=prepare, forward_time=forward, sample_time=sample,
            postprocess_time=max(0.0, (t2 - t1) - prepare - forward - sample), step_time=t2 - t0,
            spec_num_drafts=drafts, spec_num_draft_tokens=draft_tokens, spec_num_accepted_tokens=accepted,
            spec_enabled=self.spec_config is not None and self.spec_enabled,
            new_tokens=new_tokens, finished=finished)
        for listener in self.stat_listeners:
            listener(stats)
