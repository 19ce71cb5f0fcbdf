"""Token-level divergence between a baseline's and a candidate's next-token distributions.

Perplexity and task accuracy can hide damage (errors that cancel out, or a task too small to notice);
the per-token KL divergence KL(baseline || candidate) and the rate at which both pick the same top-1
token measure directly how far an optimized model has moved from the one it replaces, on every token
of the eval text. Computed in float32 on row chunks so a 2k-token window over a 50k vocabulary never
needs more than ~100 MB of temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ROW_CHUNK = 512


def token_divergence(base_logits: torch.Tensor, cand_logits: torch.Tensor) -> tuple[float, int, int]:
    """(sum of per-token KL(base || cand) in nats, top-1 matches, tokens) over aligned logit rows."""
    if base_logits.shape != cand_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(base_logits.shape)} vs {tuple(cand_logits.shape)}")
    kl_sum = 0.0
    matches = 0
    for lo in range(0, base_logits.shape[0], _ROW_CHUNK):
        b = base_logits[lo:lo + _ROW_CHUNK].float()
        c = cand_logits[lo:lo + _ROW_CHUNK].float().to(b.device)
        lp_b = torch.log_softmax(b, dim=-1)
        lp_c = torch.log_softmax(c, dim=-1)
        kl = (lp_b.exp() * (lp_b - lp_c)).sum(dim=-1).clamp_min(0.0)  # >= 0 up to rounding
        kl_sum += float(kl.double().sum())
        matches += int((b.argmax(dim=-1) == c.argmax(dim=-1)).sum())
    return kl_sum, matches, int(base_logits.shape[0])


@dataclass
class DivergenceStats:
    kl_sum: float = 0.0
    top1_matches: int = 0
    tokens: int = 0

    def add(self, kl_sum: float, matches: int, tokens: int) -> None:
        self.kl_sum += kl_sum
        self.top1_matches += matches
        self.tokens += tokens

    @property
    def kl_div(self) -> float:
        return self.kl_sum / self.tokens if self.tokens else float("nan")

    @property
    def top1_agreement(self) -> float:
        return self.top1_matches / self.tokens if self.tokens else float("nan")
