"""The verifier: which drafts the target accepts, and the one token it adds after them.

Greedy: a draft is accepted iff it is the target's argmax (output identical to plain decoding).
Sampling: rejection sampling (accept with min(1, p/q), else resample from norm(max(0, p - q))), which
keeps the output distribution; every proposer is greedy, so q is one-hot on the draft.
"""

from __future__ import annotations

import torch

from llmopt.engine.argmax import argmax
from llmopt.engine.sampler import processed_probs
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.structured_output import GrammarMatcher, draft_masks


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           generator: torch.Generator | None, grammar: GrammarMatcher | None = None) -> list[int]:
    """logits: [len(drafts)+1, V] for the last real token and each draft. Returns the accepted drafts and
    the target's own token. A grammar masks each position as the sampler would, so output stays exact."""
    if grammar is not None:
        logits = logits.clone()
        draft_masks(grammar, drafts, logits)
    if params.greedy:
        target = argmax(logits).tolist()
        n = next((i for i, d in enumerate(drafts) if d != target[i]), len(drafts))  # drafts accepted
        return drafts[:n] + [target[n]]
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
