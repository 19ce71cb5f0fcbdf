"""Turn calibration texts into fixed-length token windows: dedupe, mix by weight, sample by seed, pack.

Each source is shuffled by the seed, tokenized into one EOS-separated stream and cut into
non-overlapping `seq_len` windows; the windows a source contributes (its share of `num_samples` by
weight) are then drawn at random from that stream, so a large corpus is sampled, not just its head.
The same texts, seed and tokenizer always give the same windows.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmopt.calibrate.sources import DataSource, load_texts
from llmopt.errors import LlmoptError

# tokenize at most this many times the tokens a source needs (sampling diversity vs. time)
_OVERSAMPLE = 16


@dataclass
class CalibrationSet:
    """Token windows [N, seq_len] plus what was used to make them."""

    windows: torch.Tensor
    per_source: dict[str, int]
    num_texts: int
    num_duplicates: int
    warnings: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.windows.numel()


def _norm_key(text: str) -> str:
    return hashlib.sha1(" ".join(text.split()).encode()).hexdigest()


def dedupe(texts: list[str], seen: set[str]) -> tuple[list[str], int]:
    """Drop texts whose whitespace-normalized content was already seen (in any source)."""
    out, dups = [], 0
    for t in texts:
        k = _norm_key(t)
        if k in seen:
            dups += 1
            continue
        seen.add(k)
        out.append(t)
    return out, dups


def allocate(num_samples: int, weights: list[float]) -> list[int]:
    """Split `num_samples` by weight (largest remainder, ties to the earlier source)."""
    total = sum(weights)
    raw = [num_samples * w / total for w in weights]
    counts = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - counts[i]), i))
    for i in order[: num_samples - sum(counts)]:
        counts[i] += 1
    return counts


def _render(text: str, tokenizer, chat_template: bool) -> str:
    if not chat_template:
        return text
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False)


def pack_source(texts: list[str], tokenizer, count: int, seq_len: int, rng: random.Random,
                chat_template: bool = False) -> list[list[int]]:
    """Up to `count` windows of `seq_len` tokens drawn at random from the shuffled, packed `texts`."""
    order = list(range(len(texts)))
    rng.shuffle(order)
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    budget = count * seq_len * _OVERSAMPLE
    for i in order:
        stream.extend(tokenizer(_render(texts[i], tokenizer, chat_template), add_special_tokens=False)["input_ids"])
        if eos is not None:
            stream.append(eos)
        if len(stream) >= budget:
            break
    n_all = len(stream) // seq_len
    picks = sorted(rng.sample(range(n_all), min(count, n_all)))
    return [stream[p * seq_len:(p + 1) * seq_len] for p in picks]


def build_calibration_set(sources: list[DataSource], tokenizer, num_samples: int, seq_len: int,
                          seed: int = 0, chat_template: bool = False) -> CalibrationSet:
    """Load, dedupe, mix and pack `sources` into at most `num_samples` windows of `seq_len` tokens."""
    if not sources:
        raise LlmoptError("no calibration data: pass --data PATH (a file, a directory or a datasets name)")
    if num_samples < 1 or seq_len < 2:
        raise LlmoptError("num_samples must be >= 1 and seq_len >= 2")
    seen: set[str] = set()
    loaded: list[list[str]] = []
    dups = 0
    for s in sources:
        texts, d = dedupe(load_texts(s, tokenizer), seen)
        dups += d
        loaded.append(texts)
    counts = allocate(num_samples, [s.weight for s in sources])
    windows: list[list[int]] = []
    per_source: dict[str, int] = {}
    warnings: list[str] = []
    for idx, (s, texts, want) in enumerate(zip(sources, loaded, counts, strict=True)):
        # seeded by the source's file name, not its absolute path, so the same data gives the same
        # windows in every checkout (the CI clone and a developer's tree)
        rng = random.Random(f"{seed}:{idx}:{Path(s.path).name}")
        got = pack_source(texts, tokenizer, want, seq_len, rng, chat_template) if want and texts else []
        if len(got) < want:
            warnings.append(f"{s.path}: only {len(got)} windows of {seq_len} tokens available "
                            f"({want} requested); using {len(got)}")
        per_source[s.path] = per_source.get(s.path, 0) + len(got)
        windows.extend(got)
    if not windows:
        raise LlmoptError(f"the calibration data yields no window of {seq_len} tokens; use a smaller --seq-len "
                          "or more data")
    return CalibrationSet(torch.tensor(windows, dtype=torch.long), per_source,
                          sum(len(t) for t in loaded), dups, warnings)
