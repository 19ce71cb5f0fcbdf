"""Greedy drafts from a model, k passes batched across the speculating sequences.

- `layer_skip`: the target's first layers plus its norm and head, over the target's own pool (those
  layers' K/V equal the target's, so no cache of its own and no catch-up).
- `draft`: a separate model with the same tokenizer, its pool mirroring the target's block tables.
  `SpecState.draft_computed` is what it has cached; a round first catches up, then runs k - 1 steps.
"""

from __future__ import annotations

from llmopt.engine.model_runner import ModelRunner
from llmopt.engine.sequence import Sequence


class ModelProposer:
    def __init__(self, runner: ModelRunner, num_layers: int | None):
        """`num_layers`: run only that many layers of `runner`'s model (layer_skip); None: all (draft)."""
        self.runner, self.num_layers = runner, num_layers

    writes_kv = True  # positions num_tokens-1 .. num_tokens+k-2 of each sequence

    def propose(self, batch: list[tuple[Sequence, int]]) -> None:
        """k greedy drafts per (sequence, k), into `seq.spec.tokens`."""
        seqs = [s for s, _ in batch]
        for s, k in batch:
            s.spec.tokens = [0] * k
        own_cache = self.num_layers is None
        for j in range(max((k for _, k in batch), default=0)):
            active = [s for s in seqs if len(s.spec.tokens) > j]
            items = []
            for s in active:
                if j > 0:
                    items.append((s.block_tables, s.num_tokens - 1 + j, [s.spec.tokens[j - 1]]))
                else:  # the separate draft first catches up on the tokens it has not cached
                    start = min(s.spec.draft_computed, s.num_tokens - 1) if own_cache else s.num_tokens - 1
                    items.append((s.block_tables, start, s.token_ids[start:]))
            for s, t in zip(active, self.runner.greedy_next(items, self.num_layers), strict=True):
                s.spec.tokens[j] = t
        if own_cache:
            for s in seqs:  # positions written: the context, then drafts 1..k-1
                s.spec.draft_computed = s.num_tokens - 1 + len(s.spec.tokens)
