"""The verifier: which drafts the target accepts, and the one token the target adds after them.

- Greedy: a draft is accepted iff it equals the target's argmax, so output is token-identical to plain
  decoding.
- Sampling: standard rejection sampling (accept x with min(1, p(x)/q(x)), else resample from
  norm(max(0, p - q))), which leaves the output distribution unchanged. Every proposer is greedy, so
  q is one-hot on the draft.

Structured outputs stay exact: each scored position is masked with the request's grammar state after
the drafts before it (`structured_output.draft_masks`).
"""

from __future__ import annotations

import torch

from llmopt.engine.argmax import argmax
from llmopt.engine.sampler import processed_probs
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.structured_output import GrammarMatcher, draft_masks


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
        target = argmax(logits).tolist()
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
