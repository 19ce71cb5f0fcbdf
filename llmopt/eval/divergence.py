"""Token-level divergence between a baseline's and a candidate's next-token distributions.

Perplexity and task accuracy can hide damage (errors that cancel out, or a task too small to notice);
the per-token KL divergence KL(baseline || candidate) and the rate at which both pick the same top-1
token measure directly how far an optimized model has moved from the one it replaces.

Why a saved reference: an 8B baseline and its candidate do not fit in memory together, so the baseline
is scored first and keeps, per scored token, only its `top_k` log-probs and their token ids (as
llama.cpp's `--kl-divergence-base` keeps a file of the base model's logits). The candidate is scored
afterwards against them. KL is then taken between the two distributions coarsened to the baseline's
top-k tokens plus one bucket for all the others:

    KL_k = sum_{i in top-k} p_i log(p_i / q_i) + p_rest log(p_rest / q_rest)

By the log-sum inequality KL_k <= KL, and KL_k == KL once k covers the vocabulary (or p_rest is 0). The
reference reports the baseline's mean `p_rest`, so a reader sees how tight the bound is; top-1 agreement
is exact (the baseline's argmax is its first top-k id). Rows are processed in chunks so a 2k-token window
over a 128k vocabulary never needs more than ~100-250 MB of temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_ROW_CHUNK = 512
DEFAULT_TOP_K = 256


@dataclass
class DivergenceStats:
    """Sums over the scored tokens, and the same sums per window (`close_window` after each), from which
    the comparison takes bootstrap intervals over windows (three numbers a window: nothing per token)."""

    kl_sum: float = 0.0
    top1_matches: int = 0
    tokens: int = 0
    window_kl: list[float] = field(default_factory=list)
    window_matches: list[int] = field(default_factory=list)
    window_tokens: list[int] = field(default_factory=list)

    def add(self, kl_sum: float, matches: int, tokens: int) -> None:
        self.kl_sum += kl_sum
        self.top1_matches += matches
        self.tokens += tokens

    def close_window(self) -> None:
        """Record what was added since the previous window closed as one window."""
        self.window_kl.append(self.kl_sum - sum(self.window_kl))
        self.window_matches.append(self.top1_matches - sum(self.window_matches))
        self.window_tokens.append(self.tokens - sum(self.window_tokens))

    @property
    def kl_div(self) -> float:
        return self.kl_sum / self.tokens if self.tokens else float("nan")

    @property
    def top1_agreement(self) -> float:
        return self.top1_matches / self.tokens if self.tokens else float("nan")


class BaselineTopK:
    """The baseline's top-k next-token log-probs (float32) and ids (int32), per scored row of each
    window: k * 8 bytes a token (2 KB at the default k=256), instead of the whole vocabulary."""

    def __init__(self, top_k: int = DEFAULT_TOP_K):
        if top_k < 1:
            raise ValueError("top_k must be at least 1")
        self.top_k = top_k
        self._logprobs: dict[object, torch.Tensor] = {}
        self._ids: dict[object, torch.Tensor] = {}
        self._rest_sum = 0.0
        self._rows = 0
        self.vocab_size = 0

    def record(self, key: object, logits: torch.Tensor) -> None:
        """Keep the top-k of each row of `logits` ([rows, vocab]: positions that predict scored tokens) under `key`."""
        self.vocab_size = int(logits.shape[-1])
        k = min(self.top_k, self.vocab_size)
        lps, ids = [], []
        for lo in range(0, logits.shape[0], _ROW_CHUNK):
            lp = torch.log_softmax(logits[lo:lo + _ROW_CHUNK].float(), dim=-1)
            v, i = lp.topk(k, dim=-1)
            lps.append(v.cpu())
            ids.append(i.to(torch.int32).cpu())
            self._rest_sum += float((1.0 - v.double().exp().sum(dim=-1)).clamp_min(0.0).sum())
        self._logprobs[key] = torch.cat(lps)
        self._ids[key] = torch.cat(ids)
        self._rows += int(logits.shape[0])

    def __contains__(self, key: object) -> bool:
        return key in self._logprobs

    @property
    def exact(self) -> bool:
        """True when k covers the vocabulary: KL_k is the exact KL."""
        return self.top_k >= self.vocab_size

    @property
    def mean_rest_mass(self) -> float:
        """The baseline's mean probability outside its top-k: how loose KL_k can be."""
        return self._rest_sum / self._rows if self._rows else float("nan")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self._logprobs, self._ids) for t in d.values())

    def compare(self, key: object, logits: torch.Tensor) -> tuple[float, int, int]:
        """(sum of KL_k(base || cand) in nats, top-1 matches, rows) for the candidate's rows recorded under `key`."""
        ref_lp, ref_ids = self._logprobs[key], self._ids[key]
        if ref_lp.shape[0] != logits.shape[0]:
            raise ValueError(f"{key}: {logits.shape[0]} candidate rows against {ref_lp.shape[0]} saved")
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"vocabulary sizes differ: {logits.shape[-1]} against the baseline's {self.vocab_size}")
        kl_sum, matches = 0.0, 0
        for lo in range(0, logits.shape[0], _ROW_CHUNK):
            c = torch.log_softmax(logits[lo:lo + _ROW_CHUNK].float(), dim=-1)
            b = ref_lp[lo:lo + _ROW_CHUNK].to(c.device)
            idx = ref_ids[lo:lo + _ROW_CHUNK].to(c.device, torch.long)
            c_top = c.gather(1, idx)
            kl = (b.exp() * (b - c_top)).double().sum(dim=-1)
            if not self.exact:  # the bucket of every token outside the baseline's top-k
                p_rest = (1.0 - b.double().exp().sum(dim=-1)).clamp_min(0.0)
                q_rest = (1.0 - c_top.double().exp().sum(dim=-1)).clamp_min(1e-300)
                kl = kl + torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-300).log() - q_rest.log()), 0.0)
            kl_sum += float(kl.clamp_min(0.0).sum())  # >= 0 up to rounding
            matches += int((c.argmax(dim=-1) == idx[:, 0]).sum())
        return kl_sum, matches, int(logits.shape[0])
