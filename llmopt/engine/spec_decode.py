"""Speculative decoding inside the continuous-batching engine.

A proposer suggests k draft tokens per running sequence; the target model scores the last real token
plus the drafts in ONE forward pass (a k+1-token chunk over the paged cache, batched with everything
else in the step); `verify` keeps the longest acceptable prefix plus one token from the target.

- Greedy: a draft is accepted iff it equals the target's argmax, so output is token-identical to plain
  decoding.
- Sampling: standard rejection sampling (accept x with min(1, p(x)/q(x)), else resample from
  norm(max(0, p - q))), which leaves the output distribution unchanged. Prompt lookup (`ngram`) is a
  deterministic proposer, so q is one-hot on the draft.

KV slots written for rejected drafts are simply not counted as computed (`num_computed_tokens` only
advances over accepted tokens), so they are overwritten later and never enter the prefix cache.
Three proposers, all greedy (so q is one-hot on the draft and the rejection rule above stays exact):
- `ngram`: prompt lookup, no extra model.
- `layer_skip`: a self-draft made of the target's first layers plus its final norm and head. It shares
  the target's paged KV pool: its K/V for those layers equal the target's, so it needs no cache of its
  own and no catch-up.
- `draft`: a separate model with the same tokenizer (for example a W4A16 copy of the target from
  `llmopt quantize`), with its own paged KV pool that mirrors the target's block tables. Each sequence
  records how many of its tokens the draft has cached (`draft_computed`); a round first catches the
  draft up on the tokens it has not seen (a prefill chunk), then runs k - 1 single-token steps. Only
  the draft positions the target accepts stay counted, so rejected ones are recomputed next round.

Structured outputs stay exact: the verifier masks each scored position with the request's grammar state
after the drafts before it (`structured_output.draft_masks`), and prompt-lookup drafts are cut at the
first token the grammar refuses.

Speculation is skipped per request when its running acceptance rate falls below a threshold, and for
the whole step when the batch is large enough that verification costs more than it saves.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmopt.engine.sampler import processed_probs
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.structured_output import GrammarMatcher, draft_masks


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram", "layer_skip", "draft"] = "ngram"
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    # above num_speculative_tokens: each request adapts its k between 1 and this, as transformers'
    # assisted generation does ("heuristic" schedule): +2 after a round whose drafts were all
    # accepted, -1 after a rejection. None keeps k fixed.
    max_speculative_tokens: int | None = Field(None, ge=1, le=16)
    # draft: the draft model (alias, HF dir, .gguf or an llmopt-quantized checkpoint) and its dtype
    draft_model: str | None = None
    draft_dtype: str = "auto"
    # layer_skip: the target's first `draft_layers` layers + its head draft greedily (default: half)
    draft_layers: int | None = Field(None, ge=1)
    prompt_lookup_min: int = Field(2, ge=1)
    prompt_lookup_max: int = Field(5, ge=1)
    # dynamic disable: a request stops speculating once it has proposed at least `disable_min_drafts`
    # tokens with an acceptance rate below `disable_below_acceptance` (default: 0.3, and 0.7 for `draft`,
    # whose every draft token costs a forward of the draft model: a W4A16 copy of SmolLM2 broke even
    # at 70% acceptance on CPU, measured in docs/BENCHMARKS.md)
    disable_below_acceptance: float | None = Field(None, ge=0.0, le=1.0)
    disable_min_drafts: int = Field(16, ge=1)
    # no speculation in steps with more running sequences than this (verification would cost more)
    max_batch_size: int = Field(8, ge=1)

    @property
    def min_acceptance(self) -> float:
        """The acceptance rate below which a request stops speculating."""
        if self.disable_below_acceptance is not None:
            return self.disable_below_acceptance
        return 0.7 if self.method == "draft" else 0.3

    @model_validator(mode="after")
    def _draft(self) -> SpeculativeConfig:
        if self.max_speculative_tokens is not None and self.max_speculative_tokens < self.num_speculative_tokens:
            raise ValueError("max_speculative_tokens must be at least num_speculative_tokens")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model (a model with the target's tokenizer)")
        if self.draft_model and self.method != "draft":
            raise ValueError(f"draft_model is only used by method 'draft', not {self.method!r}")
        return self


def ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: find the most recent earlier occurrence of the longest suffix (max_n down to
    min_n tokens) in prompt + output, and propose the k tokens that followed it (continuing the
    copy through its own proposal when the match is close to the end)."""
    n_tok = len(tokens)
    if n_tok < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        pattern = arr[n_tok - n:]
        hay = arr[:n_tok - 1]  # the suffix itself must not match
        if len(hay) < n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(hay, n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            # copy what followed the match; a copy that runs into the end of the sequence goes on
            # copying its own output (LZ77-style), so a periodic tail yields k tokens, not one
            start = int(hits[-1]) + n
            out: list[int] = []
            for j in range(start, start + k):
                out.append(tokens[j] if j < n_tok else out[j - n_tok])
            return out
    return []


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           generator: torch.Generator | None, grammar: GrammarMatcher | None = None) -> list[int]:
    """logits: [len(drafts)+1, V] for the last real token and each draft. Returns the accepted drafts
    followed by one token chosen by the target (the correction or the bonus token). With a grammar
    (structured outputs), each position's distribution is the masked one the sampler would draw from,
    so a draft the grammar refuses has probability 0 and is rejected; output stays exact."""
    if grammar is not None:
        logits = logits.clone()
        draft_masks(grammar, drafts, logits)
    if params.greedy:
        target = logits.argmax(dim=-1).tolist()
        out = []
        for i, d in enumerate(drafts):
            if d != target[i]:
                break
            out.append(d)
        out.append(target[len(out)])
        return out
    probs = processed_probs(logits, params)
    out = []
    for i, d in enumerate(drafts):
        u = torch.rand((), generator=generator, device=probs.device)
        if u < probs[i, d]:  # q is one-hot on d: accept with min(1, p(d) / 1)
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        total = residual.sum()
        if total <= 0:  # p was a point mass on d (cannot happen when u < 1); keep d
            out.append(d)
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out


def spec_eligible(params: SamplingParams) -> bool:
    """Requests whose per-token processing depends on the previous token stay on the plain path."""
    return (params.logprobs is None and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and params.min_tokens == 0)
