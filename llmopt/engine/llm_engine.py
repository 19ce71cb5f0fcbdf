"""LLMEngine: add_request / step / abort_request over the scheduler, block manager and model runner.

One engine core serves `serve`, `bench` and `eval`. `step()` runs one batch and returns a RequestOutput
for every request that produced text or finished, with incremental `delta_text` for streaming, and
reports a `StepStats` to every registered listener (Prometheus metrics, benchmarks, logs).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llmopt.devices import resolve_device
from llmopt.engine.block_manager import BlockManager
from llmopt.engine.config import EngineConfig
from llmopt.engine.detokenizer import detokenize_step, init_offsets
from llmopt.engine.model_runner import ModelRunner
from llmopt.engine.outputs import CompletionOutput, RequestOutput
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.scheduler import Scheduler
from llmopt.engine.sequence import Sequence, SequenceStatus
from llmopt.engine.spec_decode import SpeculativeConfig, ngram_propose, spec_eligible, verify
from llmopt.engine.stats import FinishedRequest, StepStats
from llmopt.engine.structured_output import GrammarError, StructuredOutputCompiler
from llmopt.errors import LlmoptError
from llmopt.layers.kv_cache import PagedKVCache
from llmopt.models.base import CausalLM
from llmopt.models.loader import load_model, parse_dtype
from llmopt.models.resolve import resolve_model, weights_dir
from llmopt.models.tokenizer import load_tokenizer
from llmopt.quant.checkpoint import kv_cache_scales

DEFAULT_CPU_KV_MEMORY = 2 * 1024**3


class RequestError(LlmoptError):
    """A request the engine can never serve (too long, bad parameters). Servers answer 400."""


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

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verification step (accepted drafts + the target's own token)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    deadline: float | None = None
    finished: bool = False
    extra: dict = field(default_factory=dict)
    prompt_logprobs: list | None = None  # params.prompt_logprobs: one entry per prompt token, the first None


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.resolved = resolve_model(config.model)
        self.spec = self.resolved.spec
        self.device = resolve_device(config.device)
        self.dtype = self._compute_dtype(config.dtype, self.spec.dtype)
        self.model = load_model(self.resolved, self.dtype, self.device)
        self.weights_dir = weights_dir(self.resolved)
        self.tokenizer = load_tokenizer(self.weights_dir)
        self.eos_token_ids = _eos_ids(self.weights_dir, self.tokenizer, self.spec.eos_token_id)
        # structured outputs: compiles each constraint once (thread-safe: servers compile at the edge too)
        self.structured_outputs = StructuredOutputCompiler(self.tokenizer, self.spec.vocab_size, self.eos_token_ids)
        s = self.spec
        # a checkpoint with calibrated INT8 KV scales (llmopt quantize --kv-cache int8) defaults to an int8 cache
        kv_scales = kv_cache_scales(self.resolved)
        kv_dtype = "int8" if kv_scales is not None and config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        per_block = PagedKVCache.bytes_per_block(s.num_layers, config.block_size, s.num_kv_heads, s.head_dim,
                                                 self.dtype, kv_dtype)
        self.spec_config: SpeculativeConfig | None = config.speculative
        draft, draft_dtype = self._load_draft() if self.spec_config and self.spec_config.method == "draft" else (None, None)
        if draft is not None:  # the draft's pool mirrors the target's block for block
            ds = draft.spec
            per_block += PagedKVCache.bytes_per_block(ds.num_layers, config.block_size, ds.num_kv_heads, ds.head_dim,
                                                      draft_dtype)
        self.num_blocks = self._num_blocks(per_block)
        self.kv_cache = PagedKVCache(s.num_layers, self.num_blocks, config.block_size, s.num_kv_heads,
                                     s.head_dim, self.dtype, self.device, kv_dtype)
        if kv_scales is not None and self.kv_cache.quantized:
            self.kv_cache.set_static_scales(kv_scales.k_scale, kv_scales.v_scale)
        self.kv_cache_bytes = per_block * self.num_blocks
        limit = config.max_model_len or s.max_position_embeddings
        self.max_model_len = min(limit, s.max_position_embeddings, self.num_blocks * config.block_size)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.scheduling_policy)
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size, self.device, not config.enforce_eager)
        self.draft_runner: ModelRunner | None = None
        if draft is not None:
            dcache = PagedKVCache(ds.num_layers, self.num_blocks, config.block_size, ds.num_kv_heads, ds.head_dim,
                                  draft_dtype, self.device)
            self.draft_runner = ModelRunner(draft, dcache, config.block_size, self.device, not config.enforce_eager)
        self.spec_enabled = self.spec_config is not None  # servers turn it off under load
        self.spec_counters = SpecCounters(
            (self.spec_config.max_speculative_tokens or self.spec_config.num_speculative_tokens) if self.spec_config else 0)
        self.requests: dict[str, _Request] = {}
        self._pending: list[RequestOutput] = []
        self._pending_finished: list[FinishedRequest] = []
        self.stat_listeners: list[Callable[[StepStats], None]] = []
        self._last_prefix = (0, 0)
        self._last_preemptions = 0
        self._last_spec = (0, 0, 0)
        self._next_id = 0

    def _compute_dtype(self, requested: str, checkpoint: torch.dtype) -> torch.dtype:
        """The dtype to run a model in; `auto` takes the checkpoint's, except fp16 on a CPU (emulated
        and slow there), which runs in fp32."""
        dtype = parse_dtype(requested, checkpoint)
        if self.device.type == "cpu" and dtype == torch.float16 and requested == "auto":
            return torch.float32
        return dtype

    def _load_draft(self) -> tuple[CausalLM, torch.dtype]:
        """The separate draft model and the dtype it runs in; it must share the target's tokenizer."""
        sc = self.spec_config
        resolved = resolve_model(sc.draft_model)
        if resolved.spec.vocab_size != self.spec.vocab_size:
            raise LlmoptError(f"draft model {sc.draft_model!r} has a vocabulary of {resolved.spec.vocab_size} tokens, "
                              f"the target {self.spec.vocab_size}: speculative decoding needs the same tokenizer")
        dtok = load_tokenizer(weights_dir(resolved))
        if dtok.get_vocab() != self.tokenizer.get_vocab():
            raise LlmoptError(f"draft model {sc.draft_model!r} does not use the target's tokenizer")
        dtype = self._compute_dtype(sc.draft_dtype, resolved.spec.dtype)
        return load_model(resolved, dtype, self.device), dtype

    def _num_blocks(self, per_block: int) -> int:
        c = self.config
        if c.num_kv_blocks:
            return c.num_kv_blocks
        if c.kv_cache_memory is not None:
            n = c.kv_cache_memory // per_block
        elif self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            n = int(free * 0.85 - 1024**3) // per_block
        else:
            n = DEFAULT_CPU_KV_MEMORY // per_block
        if c.kv_cache_memory is None:
            # never preallocate more than max_num_seqs full-length sequences can use
            max_len = min(c.max_model_len or self.spec.max_position_embeddings, self.spec.max_position_embeddings)
            n = min(n, c.max_num_seqs * -(-max_len // c.block_size))
        if n < 1:
            raise LlmoptError(f"KV cache memory is too small for one block of {c.block_size} tokens "
                              f"({per_block} bytes)")
        return int(n)

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
        if not ids:
            raise RequestError("the prompt is empty")
        if any((not isinstance(t, int)) or t < 0 or t >= self.spec.vocab_size for t in ids):
            raise RequestError(f"prompt token ids must be integers in [0, {self.spec.vocab_size})")
        if params.logit_bias and max(params.logit_bias) >= self.spec.vocab_size:
            raise RequestError(f"logit_bias token ids must be in [0, {self.spec.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens, but this engine serves at most "
                               f"{self.max_model_len} tokens per sequence (max_model_len, KV pool of "
                               f"{self.num_blocks} blocks × {self.config.block_size})")
        if params.structured_outputs is not None:
            try:
                self.structured_outputs.compile(params.structured_outputs)
            except GrammarError as e:
                raise RequestError(f"structured_outputs: {e}") from None
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
        self.requests[request_id] = _Request(request_id, prompt, ids, params, seqs, deadline,
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
        self._pending.append(self._make_output(req, req.seqs))
        return True

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
            touched: dict[str, _Request] = {}
            for seq, token, lp in res.sampled:
                self._append_token(seq, token, lp, now)
                new_tokens.append((seq.request_id, now))
                touched[seq.request_id] = self.requests[seq.request_id]
            for seq, logits in res.spec_logits:
                for _ in range(self._accept_drafts(seq, logits, now)):
                    new_tokens.append((seq.request_id, now))
                touched[seq.request_id] = self.requests[seq.request_id]
            for req in touched.values():
                outputs.append(self._make_output(req, req.seqs))
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
        seq.token_ids.append(token)
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.token_times.append(now)
        if seq.logprobs is not None and lp is not None:
            seq.logprobs.append(lp)
        p = seq.params
        delta = detokenize_step(self.tokenizer, seq, p.skip_special_tokens)
        n_out = seq.num_output_tokens
        if seq.grammar is not None:
            seq.grammar.accept(token)  # the sampler's mask only offers tokens the grammar accepts
        before = len(seq.output_text)
        seq.output_text += delta
        if n_out >= p.min_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                seq.stop_reason = None
                return self._finish(seq, "stop")
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return self._finish(seq, "stop")
            if p.stop and self._check_stop_strings(seq, before):
                return self._finish(seq, "stop")
        if seq.grammar is not None and seq.grammar.is_terminated:  # the constrained output is complete
            seq.output_text += detokenize_step(self.tokenizer, seq, p.skip_special_tokens, final=True)
            seq.stop_reason = None
            return self._finish(seq, "stop")
        if (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            seq.output_text += detokenize_step(self.tokenizer, seq, p.skip_special_tokens, final=True)
            return self._finish(seq, "length")

    def _check_stop_strings(self, seq: Sequence, before: int) -> bool:
        text = seq.output_text
        for stop in seq.params.stop:
            idx = text.find(stop, max(0, before - len(stop) + 1))
            if idx != -1:
                end = idx + len(stop) if seq.params.include_stop_str_in_output else idx
                seq.output_text = text[:end]
                seq.stop_reason = stop
                return True
        return False

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

    def _visible_text(self, seq: Sequence) -> str:
        """Text safe to stream: hold back a tail that could still become a stop string."""
        text = seq.output_text
        if seq.is_finished or not seq.params.stop or seq.params.include_stop_str_in_output:
            return text
        hold = 0
        for stop in seq.params.stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return text[:len(text) - hold] if hold else text

    def _make_output(self, req: _Request, seqs: list[Sequence]) -> RequestOutput:
        comps = []
        for seq in seqs:
            visible = self._visible_text(seq)
            delta = visible[seq.sent_text_len:]
            seq.sent_text_len = max(seq.sent_text_len, len(visible))
            comps.append(CompletionOutput(seq.index, visible, list(seq.output_token_ids), seq.finish_reason,
                                          seq.stop_reason, seq.logprobs, delta))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, comps, req.finished,
                             seqs[0].metrics, seqs[0].metrics.num_cached_tokens, req.prompt_logprobs)

    def _report(self, sched, t0, t1, t2, prepare, forward, sample, n_prefill, n_decode, new_tokens,
                finished) -> None:
        if not self.stat_listeners:
            return
        bm = self.block_manager
        q0, h0 = self._last_prefix
        self._last_prefix = (bm.prefix_queries, bm.prefix_hits)
        pre = self.scheduler.num_preemptions - self._last_preemptions
        self._last_preemptions = self.scheduler.num_preemptions
        sc = self.spec_counters
        d0, t0_, a0 = self._last_spec
        self._last_spec = (sc.num_drafts, sc.num_draft_tokens, sc.num_accepted_tokens)
        stats = StepStats(
            now=t2, num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage, prefix_cache_queries=bm.prefix_queries - q0,
            prefix_cache_hits=bm.prefix_hits - h0, num_preemptions=pre, batch_size=len(sched.scheduled),
            num_prefill_tokens=n_prefill, num_decode_tokens=n_decode, schedule_time=t1 - t0,
            prepare_time=prepare, forward_time=forward, sample_time=sample,
            postprocess_time=max(0.0, (t2 - t1) - prepare - forward - sample), step_time=t2 - t0,
            spec_num_drafts=sc.num_drafts - d0, spec_num_draft_tokens=sc.num_draft_tokens - t0_,
            spec_num_accepted_tokens=sc.num_accepted_tokens - a0,
            spec_enabled=self.spec_config is not None and self.spec_enabled,
            new_tokens=new_tokens, finished=finished)
        for listener in self.stat_listeners:
            listener(stats)


def _eos_ids(directory, tokenizer, spec_eos: list[int]) -> list[int]:
    ids: list[int] = list(spec_eos)
    gen = directory / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            ids.extend(eos if isinstance(eos, list) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))
