"""Sampler: grammar masks, logit bias, penalties, temperature, top-k/p, min-p, seeds and logprobs.

Greedy rows take a plain argmax (the fast path). Sampling is the exponential race (argmax of p / E,
E ~ Exp(1)): a categorical draw that lets each request use its own seeded generator. Grammar masks
come first, as in vLLM, so logprobs are the masked distribution's, and a constrained row skips the
min_tokens mask: its grammar alone decides when it may end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llmopt.engine.argmax import argmax
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.structured_output import mask_rows

if TYPE_CHECKING:  # the verifier (imported by sequence's spec_decode package) imports this module
    from llmopt.engine.sequence import Sequence


def _apply_penalties(logits: torch.Tensor, rows: list[Sequence]) -> None:
    """In vLLM's order: logit bias, repetition / presence / frequency penalties, the min_tokens mask."""
    for i, r in enumerate(rows):
        p = r.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.token_ids)), dtype=torch.long, device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            out = r.output_token_ids
            if out:
                ids = torch.tensor(out, dtype=torch.long, device=logits.device)
                counts = torch.zeros(logits.shape[1], device=logits.device).index_add_(
                    0, ids, torch.ones_like(ids, dtype=torch.float32))
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        stop = r.stop_ids_for_min_tokens
        if p.min_tokens and r.grammar is None and r.num_output_tokens < p.min_tokens and stop:
            logits[i, list(stop)] = float("-inf")


def _needs_processing(p: SamplingParams, num_out: int) -> bool:
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or bool(p.logit_bias) or (p.min_tokens > 0 and num_out < p.min_tokens))


def sample(logits: torch.Tensor, rows: list[Sequence]) -> tuple[list[int], list[dict[int, float] | None]]:
    """logits: [N, V] float32, one row per sequence in `rows`. Returns the chosen ids and per row the top-n
    logprobs (plus the chosen token's) before bias and penalties, as vLLM reports them, or None."""
    g_rows = [i for i, r in enumerate(rows) if r.grammar is not None]
    if g_rows:
        logits = logits.clone()
        mask_rows(logits, g_rows, [rows[i].grammar for i in g_rows])
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(r.params.logprobs is not None for r in rows) else None
    if any(_needs_processing(r.params, r.num_output_tokens) for r in rows):
        logits = logits if g_rows else logits.clone()
        _apply_penalties(logits, rows)
    s_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not s_idx:  # all greedy: the fast path
        chosen = argmax(logits)
    else:
        chosen = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        g_idx = [i for i, r in enumerate(rows) if r.params.greedy]
        if g_idx:
            chosen[g_idx] = argmax(logits[g_idx])
        chosen[s_idx] = _sample_rows(logits[s_idx], [rows[i] for i in s_idx])
    token_ids = chosen.tolist()
    out_lp: list[dict[int, float] | None] = []
    for i, r in enumerate(rows):
        if r.params.logprobs is None:
            out_lp.append(None)
            continue
        vals, ids = raw_logprobs[i].topk(r.params.logprobs)
        d = dict(zip(ids.tolist(), vals.tolist(), strict=True))
        d[token_ids[i]] = float(raw_logprobs[i, token_ids[i]])
        out_lp.append(d)
    return token_ids, out_lp


def _filtered_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masking (-inf), one SamplingParams per row."""
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
    logits = logits / temps
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p) or any(m > 0 for m in min_p):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        vocab = logits.shape[1]
        ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=dev).unsqueeze(1)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        remove = ranks >= ks
        ps = torch.tensor(top_p, device=dev).unsqueeze(1)
        cum = probs.cumsum(dim=-1)
        remove |= (cum - probs) > ps  # keep the smallest prefix whose mass reaches top_p
        mp = torch.tensor(min_p, device=dev).unsqueeze(1)
        remove |= probs < mp * probs[:, :1]
        remove[:, 0] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)
    return logits


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from, for every row of `logits` under one request's params."""
    return _filtered_logits(logits, [params] * logits.shape[0]).softmax(dim=-1)


def _sample_rows(logits: torch.Tensor, rows: list[Sequence]) -> torch.Tensor:
    probs = _filtered_logits(logits, [r.params for r in rows]).softmax(dim=-1)
    noise = torch.empty_like(probs)
    for i, r in enumerate(rows):
        noise[i].exponential_(generator=r.generator)
    return (probs / noise).argmax(dim=-1)
