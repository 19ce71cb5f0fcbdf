"""HybridBlockManager: one BlockManager per KV group, behind the BlockManager interface.

For models that mix full and sliding-window layers (Gemma 3), the sliding layers get their own pool,
as in vLLM's hybrid allocator: group 0 (full layers) keeps every block, each sliding group gives back
what left its window. A cached prefix of n blocks is a hit only if group 0 has all n and each sliding
group still has the blocks in its window before position n * block_size (earlier ones are `skipped`).
"""

from __future__ import annotations

from llmopt.engine.block_manager import BlockManager
from llmopt.engine.sequence import Sequence


class PrefixHit(list):
    """Group 0's cached blocks (a list, like BlockManager's hits) plus each sliding group's
    (skipped leading blocks, cached blocks) for the same prefix."""

    def __init__(self, full: list[int], sliding: list[tuple[int, list[int]]]):
        super().__init__(full)
        self.sliding = sliding


class HybridBlockManager:
    def __init__(self, full: BlockManager, sliding: list[BlockManager]):
        assert full.group == 0 and all(m.release_window for m in sliding)
        self.full, self.sliding = full, sliding

    def __getattr__(self, name: str):
        """What the engine reads and the scheduler counts is group 0's: its pool size, free blocks, block
        size and prefix-cache counters (a prefix is a hit only where group 0 has it)."""
        return getattr(self.full, name)

    @property
    def usage(self) -> float:
        """The binding pool's: the fullest group."""
        return max(m.usage for m in (self.full, *self.sliding))

    # ---- prefix lookup and allocation -------------------------------------------------------------
    def lookup_prefix(self, seq: Sequence) -> PrefixHit:
        full = self.full.lookup_prefix(seq)
        bs = self.block_size
        for n in range(len(full), 0, -1):
            runs = []
            for m in self.sliding:
                first = max(0, n * bs - m.release_window + 1) // bs  # type: ignore[operator]
                run = m.cached_run(seq, first, n)
                if run is None:
                    break
                runs.append((first, run))
            else:
                return PrefixHit(full[:n], runs)
        return PrefixHit([], [(0, []) for _ in self.sliding])

    def _sliding_hits(self, hits: list[int]) -> list[tuple[int, list[int]]]:
        if isinstance(hits, PrefixHit):
            return hits.sliding
        assert not hits, "cached blocks come from lookup_prefix (a PrefixHit), which also finds the sliding ones"
        return [(0, [])] * len(self.sliding)

    def can_allocate(self, hits: list[int], num_tokens: int) -> bool:
        return self.full.can_allocate(hits, num_tokens) and all(
            m.can_allocate(run, num_tokens, skipped) for m, (skipped, run) in zip(self.sliding, self._sliding_hits(hits),
                                                                                  strict=True))

    def allocate(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        for m, (skipped, run) in zip(self.sliding, self._sliding_hits(hits), strict=True):
            m.allocate(seq, run, num_tokens, skipped)
        self.full.allocate(seq, hits, num_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return all(m.can_append(seq, num_new_tokens) for m in (self.full, *self.sliding))

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        for m in (self.full, *self.sliding):
            m.append(seq, num_new_tokens)

    def record_progress(self, seq: Sequence) -> None:
        for m in (self.full, *self.sliding):
            m.record_progress(seq)

    def free(self, seq: Sequence) -> None:
        for m in (*self.sliding, self.full):
            m.free(seq)

    def reset_prefix_cache(self) -> None:
        for m in (self.full, *self.sliding):
            m.reset_prefix_cache()
