"""Perplexity of a token stream with the HF perplexity-guide windowing, through the engine.

Protocol (https://huggingface.co/docs/transformers/perplexity): the text is tokenized once; window k
covers tokens [k*stride, k*stride + seq_len); only the tokens not already scored by the previous
window are scored (the last `stride` ones; all of them in the first window), and a window's first
token is never scored because nothing precedes it inside the window. With stride == seq_len (the
default) the windows do not overlap. ppl = exp(sum NLL / scored tokens).

Scoring runs through `iter_logits`, so several windows share a forward pass (batched by total
tokens). When a second engine is given, the same windows run through it in lockstep and the
token-level KL divergence and top-1 agreement between the two are accumulated window by window, so
no more than one chunk of logits per engine is ever held in memory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from llmopt.engine.llm_engine import LLMEngine
from llmopt.engine.scoring import iter_logits
from llmopt.errors import LlmoptError
from llmopt.eval.divergence import DivergenceStats, token_divergence

# rows of [tokens, vocab] processed at once by the NLL/KL kernels: bounds temporaries to ~100 MB
_ROW_CHUNK = 512
# logits of one lockstep chunk are held for the baseline while the candidate runs: cap their memory
_LOCKSTEP_LOGIT_BYTES = 1 << 30


@dataclass(frozen=True)
class Window:
    """Tokens [begin, end) of the stream; positions >= score_from inside the window are scored."""

    begin: int
    end: int
    score_from: int

    @property
    def length(self) -> int:
        return self.end - self.begin

    @property
    def num_scored(self) -> int:
        return self.length - self.score_from


def make_windows(num_tokens: int, seq_len: int, stride: int | None = None) -> list[Window]:
    """The HF guide's loop: `for begin in range(0, n, stride)`, scoring `end - prev_end` tokens."""
    if seq_len < 2:
        raise LlmoptError("seq_len must be at least 2")
    stride = stride or seq_len
    if not 1 <= stride <= seq_len:
        raise LlmoptError(f"stride must be between 1 and seq_len ({seq_len}), got {stride}")
    windows: list[Window] = []
    prev_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + seq_len, num_tokens)
        target_len = end - prev_end
        score_from = max(1, (end - begin) - target_len)
        if score_from < end - begin:
            windows.append(Window(begin, end, score_from))
        prev_end = end
        if end == num_tokens:
            break
    return windows


@dataclass
class NllStats:
    """Running sum of token negative log-likelihoods (float64, so 10^6 tokens lose nothing)."""

    nll_sum: float = 0.0
    tokens: int = 0

    def add(self, nll: torch.Tensor) -> None:
        self.nll_sum += float(nll.double().sum())
        self.tokens += int(nll.numel())

    @property
    def nll(self) -> float:
        return self.nll_sum / self.tokens if self.tokens else float("nan")

    @property
    def ppl(self) -> float:
        return math.exp(self.nll) if self.tokens else float("nan")


def token_nll(logits: torch.Tensor, ids: torch.Tensor, score_from: int) -> torch.Tensor:
    """NLL of ids[score_from:] given the logits of the positions before them: [num_scored] float32."""
    out = []
    for lo in range(score_from, ids.numel(), _ROW_CHUNK):
        hi = min(lo + _ROW_CHUNK, ids.numel())
        rows = logits[lo - 1:hi - 1]
        target = ids[lo:hi].to(rows.device)
        out.append(torch.logsumexp(rows, dim=-1) - rows.gather(1, target.unsqueeze(1)).squeeze(1))
    return torch.cat(out).cpu()


@dataclass
class TextScore:
    """What scoring the eval text produced: NLL per engine, divergence vs the first engine."""

    protocol: dict
    nll: list[NllStats]
    divergence: DivergenceStats | None = None
    seconds: float = 0.0
    per_window_nll: list[list[float]] = field(default_factory=list)  # [engine][window] mean NLL

    def to_json(self, index: int = 0) -> dict:
        s = self.nll[index]
        return {"ppl": s.ppl, "nll": s.nll, "tokens": s.tokens, "seconds": round(self.seconds, 3),
                **self.protocol}


def default_batch_tokens(seq_len: int, device: torch.device) -> int:
    """Windows per forward: a few on CPU (GEMMs are already efficient at 2k rows), more on GPUs."""
    target = 16384 if device.type == "cuda" else 4096
    return max(seq_len, (target // seq_len) * seq_len)


def _chunks(windows: list[Window], budget: int) -> list[list[int]]:
    out: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, w in enumerate(windows):
        if cur and total + w.length > budget:
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += w.length
    if cur:
        out.append(cur)
    return out


def score_text(engines: Sequence[LLMEngine], token_ids: list[int], seq_len: int, stride: int | None = None,
               max_batch_tokens: int | None = None,
               progress: Callable[[int, int], None] | None = None) -> TextScore:
    """Perplexity of `token_ids` under every engine; with two engines also KL(first || second) and
    top-1 agreement over the same scored tokens. `progress(scored_tokens, total)` is called per window."""
    if not engines:
        raise LlmoptError("score_text needs at least one engine")
    if len(token_ids) < 2:
        raise LlmoptError("the perplexity text has fewer than 2 tokens")
    for eng in engines:
        if seq_len > eng.max_model_len:
            raise LlmoptError(f"--seq-len {seq_len} exceeds the engine's max_model_len {eng.max_model_len}")
    windows = make_windows(len(token_ids), seq_len, stride)
    batch = max_batch_tokens or default_batch_tokens(seq_len, engines[0].device)
    batch = max(batch, seq_len)
    vocab = engines[0].spec.vocab_size
    lockstep = len(engines) > 1
    chunk_budget = min(batch, max(seq_len, _LOCKSTEP_LOGIT_BYTES // (4 * vocab))) if lockstep else batch
    stats = [NllStats() for _ in engines]
    per_window: list[list[float]] = [[0.0] * len(windows) for _ in engines]
    div = DivergenceStats() if lockstep else None
    total_scored = sum(w.num_scored for w in windows)
    done = 0
    ids_all = torch.tensor(token_ids, dtype=torch.long)
    t0 = time.perf_counter()
    for chunk in _chunks(windows, chunk_budget):
        seqs = [token_ids[windows[i].begin:windows[i].end] for i in chunk]
        held: dict[int, torch.Tensor] = {}
        for e, eng in enumerate(engines):
            for j, logits in iter_logits(eng, seqs, max_batch_tokens=batch):
                w = windows[chunk[j]]
                ids = ids_all[w.begin:w.end]
                nll = token_nll(logits, ids, w.score_from)
                stats[e].add(nll)
                per_window[e][chunk[j]] = float(nll.double().mean())
                if not lockstep:
                    done += w.num_scored
                    if progress:
                        progress(done, total_scored)
                elif e == 0:
                    held[j] = logits[w.score_from - 1:w.length - 1]
                else:
                    div.add(*token_divergence(held.pop(j), logits[w.score_from - 1:w.length - 1]))
                    done += w.num_scored
                    if progress:
                        progress(done, total_scored)
    protocol = {"seq_len": seq_len, "stride": stride or seq_len, "windows": len(windows),
                "text_tokens": len(token_ids), "batch_tokens": batch,
                "protocol": ("non-overlapping windows" if (stride or seq_len) == seq_len else
                             "sliding window, last `stride` tokens scored") + " (HF perplexity guide)"}
    return TextScore(protocol, stats, div, time.perf_counter() - t0, per_window)
