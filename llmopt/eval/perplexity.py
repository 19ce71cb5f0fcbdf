"""Perplexity of a token stream with the HF perplexity-guide windowing, through the engine.

Protocol (https://huggingface.co/docs/transformers/perplexity): the text is tokenized once; window k
covers tokens [k*stride, k*stride + seq_len); only the tokens not already scored by the previous
window are scored (the last `stride` ones; all of them in the first window), and a window's first
token is never scored because nothing precedes it inside the window. With stride == seq_len (the
default) the windows do not overlap. ppl = exp(sum NLL / scored tokens).

Scoring runs through `iter_hidden`, so several windows share a forward pass (batched by total
tokens). A comparison scores the baseline first, keeping its top-k log-probs per scored token
(`divergence.BaselineTopK`), then the candidate against them: the two models are never in memory
together, and no more than one forward's logits are held at a time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llmopt.engine.llm_engine import LLMEngine
from llmopt.engine.scoring import iter_hidden
from llmopt.errors import LlmoptError
from llmopt.eval.divergence import BaselineTopK, DivergenceStats

# float32 logits computed at once (rows x vocab x 4 bytes): 64 MB, 130 rows of a 128k vocabulary; the
# log-softmax temporaries of the NLL and KL add a few times that
_LOGIT_CHUNK_BYTES = 1 << 26


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


def rows_nll(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """NLL of `target[i]` under row i of `logits` ([rows, vocab]): [rows] float32 on the CPU."""
    target = target.to(logits.device)
    return (torch.logsumexp(logits, dim=-1) - logits.gather(1, target.unsqueeze(1)).squeeze(1)).cpu()


@dataclass
class TextScore:
    """What scoring the eval text produced: NLL per engine, divergence vs the first engine."""

    protocol: dict
    nll: list[NllStats]
    divergence: DivergenceStats | None = None
    seconds: float = 0.0
    per_window_nll: list[list[float]] = field(default_factory=list)  # [engine][window] mean NLL
    window_tokens: list[int] = field(default_factory=list)  # scored tokens per window (same for every engine)

    def to_json(self, index: int = 0) -> dict:
        s = self.nll[index]
        return {"ppl": s.ppl, "nll": s.nll, "tokens": s.tokens, "seconds": round(self.seconds, 3),
                **self.protocol}


def default_batch_tokens(seq_len: int, device: torch.device) -> int:
    """Windows per forward: a few on CPU (GEMMs are already efficient at 2k rows), more on GPUs."""
    target = 16384 if device.type == "cuda" else 4096
    return max(seq_len, (target // seq_len) * seq_len)


@torch.inference_mode()
def score_text(engine: LLMEngine, token_ids: list[int], seq_len: int, stride: int | None = None,
               max_batch_tokens: int | None = None, progress: Callable[[int, int], None] | None = None,
               record: BaselineTopK | None = None, compare_to: BaselineTopK | None = None) -> TextScore:
    """Perplexity of `token_ids` under `engine`. `record` keeps this engine's top-k log-probs on the scored
    tokens (the baseline's pass); `compare_to` measures KL(baseline || this engine) and top-1 agreement
    against such a record (the candidate's pass, on the same windows). `progress(scored, total)` per window."""
    if len(token_ids) < 2:
        raise LlmoptError("the perplexity text has fewer than 2 tokens")
    if seq_len > engine.max_model_len:
        raise LlmoptError(f"--seq-len {seq_len} exceeds the engine's max_model_len {engine.max_model_len}")
    windows = make_windows(len(token_ids), seq_len, stride)
    batch = max(max_batch_tokens or default_batch_tokens(seq_len, engine.device), seq_len)
    stats = NllStats()
    per_window = [0.0] * len(windows)
    div = DivergenceStats() if compare_to is not None else None
    total_scored = sum(w.num_scored for w in windows)
    done = 0
    ids_all = torch.tensor(token_ids, dtype=torch.long)
    rows = max(16, _LOGIT_CHUNK_BYTES // (4 * engine.spec.vocab_size))
    t0 = time.perf_counter()
    for j, hidden in iter_hidden(engine, [token_ids[w.begin:w.end] for w in windows], max_batch_tokens=batch):
        w = windows[j]
        nll = []
        # only the rows that predict scored tokens, in chunks of `rows`
        for lo in range(w.score_from - 1, w.length - 1, rows):
            hi = min(lo + rows, w.length - 1)
            logits = engine.model.compute_logits(hidden[lo:hi])
            nll.append(rows_nll(logits, ids_all[w.begin + lo + 1:w.begin + hi + 1]))
            if record is not None:
                record.record((j, lo), logits)
            if div is not None:
                div.add(*compare_to.compare((j, lo), logits))
            del logits
        if div is not None:
            div.close_window()
        window_nll = torch.cat(nll)
        stats.add(window_nll)
        per_window[j] = float(window_nll.double().mean())
        done += w.num_scored
        if progress:
            progress(done, total_scored)
    protocol = {"seq_len": seq_len, "stride": stride or seq_len, "windows": len(windows),
                "text_tokens": len(token_ids), "batch_tokens": batch,
                "protocol": ("non-overlapping windows" if (stride or seq_len) == seq_len else
                             "sliding window, last `stride` tokens scored") + " (HF perplexity guide)"}
    return TextScore(protocol, [stats], div, time.perf_counter() - t0, [per_window],
                     [w.num_scored for w in windows])


def compare_scores(baseline: TextScore, candidate: TextScore) -> TextScore:
    """One TextScore of both passes: NLL [baseline, candidate], the candidate's divergence."""
    return TextScore(candidate.protocol, baseline.nll + candidate.nll, candidate.divergence,
                     baseline.seconds + candidate.seconds, baseline.per_window_nll + candidate.per_window_nll,
                     candidate.window_tokens)
