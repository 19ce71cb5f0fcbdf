"""Prompt lookup (`ngram`): drafts copied from an earlier occurrence of the sequence's own suffix."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from llmopt.engine.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:  # a Sequence holds a SpecState of this package
    from llmopt.engine.sequence import Sequence


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


class NgramProposer:
    """Deterministic, no model, no KV writes: drafts are copied from the sequence's own tokens."""

    writes_kv = False

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, batch: list[tuple[Sequence, int]]) -> None:
        """Up to k drafts per (sequence, k), into `seq.spec.tokens`."""
        for seq, k in batch:
            drafts = ngram_propose(seq.token_ids, k, self.min_n, self.max_n)
            if seq.grammar is not None:  # drop drafts the grammar refuses (they could only be rejected)
                drafts = drafts[:seq.grammar.validate(drafts)]
            seq.spec.tokens = drafts
