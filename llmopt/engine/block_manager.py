"""Block manager: a free list, reference counts and a prefix cache over one KV group's paged pool.

A full block is keyed by a chained hash of (parent hash, its token ids), so a hit on block i means the
whole prefix matches (tokens are compared too: hashes can collide). Freed hashed blocks stay as
evictable cache, evicted LRU. Where every layer of the pool slides over one window, blocks no later
query can see are given back as the sequence advances (their table entries stay, masked).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from llmopt.engine.sequence import BlockTable, Sequence

# the table entry of a block a sequence never took or gave back (it left a sliding window): any valid
# block id works, because attention masks those positions out
NO_BLOCK = 0


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # the chained hash of a full block in the prefix cache
    token_ids: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 release_window: int | None = None, group: int = 0):
        """`release_window`: the window every layer of this pool slides over (None: keep every block).
        `group`: which of a sequence's block tables this manager keeps (`Sequence.kv_table`)."""
        self.group, self.num_blocks, self.block_size = group, num_blocks, block_size
        self.enable_prefix_caching, self.release_window = enable_prefix_caching, release_window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref_count 0 but hashed, LRU first
        self.hash_to_block: dict[int, int] = {}
        self.prefix_queries = self.prefix_hits = 0  # tokens, like vLLM's prefix_cache_queries / hits
        self._reported = (0, 0)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences (evictable cache counts as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, seq: Sequence, num_full: int) -> list[int]:
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else 0
            hashes.append(hash((parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))))
        return hashes[:num_full]

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks, leaving at least one token to compute
        (its logits are sampled); none for prompt_logprobs requests: they need every position's logits."""
        if not self._cacheable(seq):
            return []
        max_full = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for i, h in enumerate(self._block_hashes(seq, max_full)):
            bid = self._cached(seq, i, h)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def cached_run(self, seq: Sequence, start: int, end: int) -> list[int] | None:
        """The cached blocks for the sequence's full blocks start..end-1, or None if one is missing."""
        hashes = self._block_hashes(seq, end)
        run = [self._cached(seq, i, hashes[i]) for i in range(start, end)]
        return None if None in run else run  # type: ignore[return-value]

    def _cached(self, seq: Sequence, i: int, h: int) -> int | None:
        bid = self.hash_to_block.get(h)
        if bid is None:
            return None
        bs = self.block_size
        if self.blocks[bid].token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
            return None  # hash collision: treat as a miss
        return bid

    def _cacheable(self, seq: Sequence) -> bool:
        return self.enable_prefix_caching and seq.params.prompt_logprobs is None

    def count_prefix_lookup(self, seq: Sequence, hits: list[int]) -> None:
        """Count a lookup that led to scheduling (a sequence that has to wait is counted when it runs)."""
        if not self._cacheable(seq):
            return
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += len(hits) * self.block_size

    def take_prefix_counts(self) -> tuple[int, int]:
        """(queried, hit) tokens since the previous call: one step's share, for StepStats."""
        q0, h0 = self._reported
        self._reported = (self.prefix_queries, self.prefix_hits)
        return self.prefix_queries - q0, self.prefix_hits - h0

    def can_allocate(self, hits: list[int], num_tokens: int, skipped: int = 0) -> bool:
        """Can a new sequence take `hits` from the cache and hold `num_tokens` tokens in total?
        `skipped`: leading blocks it never takes (they left a sliding window before the hits)."""
        from_evictable = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        fresh = self.blocks_needed(num_tokens) - skipped - len(hits)
        return fresh + from_evictable <= self.num_free_blocks

    def allocate(self, seq: Sequence, hits: list[int], num_tokens: int, skipped: int = 0) -> None:
        """Give `seq` the cached `hits` (after `skipped` leading entries that stay released) and fresh
        blocks up to `num_tokens`; the hit positions count as computed."""
        for bid in hits:
            block = self.blocks[bid]
            if block.ref_count == 0:
                self.evictable.pop(bid, None)
            block.ref_count += 1
        t = seq.kv_table(self.group)
        t.blocks = [NO_BLOCK] * skipped + list(hits)
        t.num_hashed = t.num_released = skipped
        t.num_hashed += len(hits)
        seq.num_computed_tokens = len(t.blocks) * self.block_size
        seq.metrics.num_cached_tokens = seq.num_computed_tokens
        self._grow(t, num_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.kv_table(self.group).blocks)
        return need <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        self._grow(seq.kv_table(self.group), seq.num_computed_tokens + num_new_tokens)

    def _grow(self, t: BlockTable, num_tokens: int) -> None:
        need = self.blocks_needed(num_tokens) - len(t.blocks)
        for _ in range(need):
            t.blocks.append(self._take_free())

    def _take_free(self) -> int:
        if self.free_ids:
            bid = self.free_ids.popleft()
        else:
            bid, _ = self.evictable.popitem(last=False)  # least recently used cached block
            self._uncache(self.blocks[bid])
        block = self.blocks[bid]
        assert block.ref_count == 0, f"block {bid} handed out while in use"
        block.ref_count = 1
        return bid

    def record_progress(self, seq: Sequence) -> None:
        """After a step: commit newly full blocks to the prefix cache, then give back what left the window."""
        self.commit_full_blocks(seq)
        self.release_out_of_window(seq)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register blocks whose tokens are all computed, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        t = seq.kv_table(self.group)
        num_full = min(seq.num_computed_tokens // self.block_size, len(t.blocks))
        if num_full <= t.num_hashed:
            return
        hashes = self._block_hashes(seq, num_full)
        bs = self.block_size
        for i in range(t.num_hashed, num_full):
            block = self.blocks[t.blocks[i]]
            if hashes[i] not in self.hash_to_block:
                block.hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                self.hash_to_block[hashes[i]] = block.block_id
        t.num_hashed = num_full

    def _release(self, bid: int) -> None:
        block = self.blocks[bid]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {bid} freed twice"
        if block.ref_count == 0:
            if block.hash is not None and self.hash_to_block.get(block.hash) == bid:
                self.evictable[bid] = None
            else:
                self._uncache(block)
                self.free_ids.append(bid)

    def _uncache(self, block: Block) -> None:
        """Forget a block's prefix-cache identity (and its hash entry, where that still points here)."""
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash = block.token_ids = None

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks. Tail blocks are released first so they are evicted first."""
        t = seq.kv_table(self.group)
        for bid in reversed(t.blocks[t.num_released:]):
            self._release(bid)
        t.blocks = []
        t.num_hashed = t.num_released = 0
        seq.num_computed_tokens = 0
        seq.spec.draft_computed = 0

    def release_out_of_window(self, seq: Sequence) -> None:
        """Give back the leading blocks no later query sees (the next sits at num_computed_tokens). Called
        after `commit_full_blocks`, so a released full block stays cached (evictable)."""
        if self.release_window is None:
            return
        t = seq.kv_table(self.group)
        first_seen = seq.num_computed_tokens - self.release_window + 1
        upto = min(max(0, first_seen) // self.block_size, len(t.blocks))
        for i in range(t.num_released, upto):
            self._release(t.blocks[i])
        t.num_released = max(t.num_released, upto)

    def reset_prefix_cache(self) -> None:
        """Drop every evictable cached block (used by benchmarks to compare cold runs)."""
        for bid in list(self.evictable):
            self._uncache(self.blocks[bid])
            self.free_ids.append(bid)
        self.evictable.clear()
