"""BlockManager on its own: allocation, prefix-cache hits, commit, free and eviction, per-step counts."""

from __future__ import annotations

from llmopt.engine.block_manager import BlockManager
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.sequence import Sequence


def _seq(ids: list[int]) -> Sequence:
    return Sequence("r", 0, ids, SamplingParams(), 0.0)


def _run_to_computed(bm: BlockManager, seq: Sequence) -> None:
    hits = bm.lookup_prefix(seq)
    bm.allocate(seq, hits, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_full_blocks(seq)


def test_a_freed_sequence_leaves_its_full_blocks_as_a_prefix_for_the_next():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq(list(range(10)))  # two full blocks and a partial one
    _run_to_computed(bm, a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(a)
    assert bm.num_free_blocks == 8 and len(bm.evictable) == 2  # the full blocks stay cached
    b = _seq(list(range(9)) + [99])
    hits = bm.lookup_prefix(b)
    assert len(hits) == 2
    bm.allocate(b, hits, b.num_tokens)
    assert b.num_computed_tokens == 8 and b.metrics.num_cached_tokens == 8


def test_the_last_token_is_never_taken_from_the_cache():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _seq(list(range(8)))
    _run_to_computed(bm, a)
    bm.free(a)
    assert len(bm.lookup_prefix(_seq(list(range(8))))) == 1  # its logits are needed to sample


def test_counts_are_taken_per_step_and_only_for_scheduled_lookups():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq(list(range(9)))
    _run_to_computed(bm, a)
    bm.free(a)
    b = _seq(list(range(9)))
    hits = bm.lookup_prefix(b)
    assert bm.take_prefix_counts() == (0, 0)  # a lookup alone counts nothing
    bm.count_prefix_lookup(b, hits)
    assert bm.take_prefix_counts() == (9, 8)
    assert bm.take_prefix_counts() == (0, 0)
    assert (bm.prefix_queries, bm.prefix_hits) == (9, 8)  # the totals stay


def test_eviction_reuses_the_least_recently_freed_blocks_and_forgets_them():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = _seq([1, 2, 3])
    _run_to_computed(bm, a)
    bm.free(a)
    c = _seq([7, 8, 9, 10])
    bm.allocate(c, bm.lookup_prefix(c), c.num_tokens)  # needs both blocks: the cached one is evicted
    assert bm.num_free_blocks == 0 and not bm.hash_to_block
    bm.free(c)
    assert bm.lookup_prefix(_seq([1, 2, 3])) == []


def test_reset_prefix_cache_drops_only_unheld_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = _seq([1, 2, 3]), _seq([5, 6, 7])
    _run_to_computed(bm, a)
    _run_to_computed(bm, b)
    bm.free(a)
    bm.reset_prefix_cache()
    assert not bm.evictable and len(bm.hash_to_block) == 1  # b still holds its block
    assert bm.lookup_prefix(_seq([1, 2, 3])) == []


def test_nothing_is_counted_without_prefix_caching():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    seq = _seq([1, 2, 3])
    bm.count_prefix_lookup(seq, bm.lookup_prefix(seq))
    assert bm.take_prefix_counts() == (0, 0)


def test_release_out_of_window_gives_back_blocks_no_query_sees_and_keeps_them_cached():
    """Window 6, blocks of 4: at 14 computed tokens the next query (position 14) sees positions 9..14, so
    blocks 0 and 1 (positions 0..7) go back; the full ones stay in the prefix cache as evictable, and
    freeing the sequence later does not release them twice."""
    bm = BlockManager(num_blocks=8, block_size=4, release_window=6)
    a = _seq(list(range(14)))
    _run_to_computed(bm, a)
    assert len(a.block_table) == 4 and bm.num_free_blocks == 4
    bm.release_out_of_window(a)
    assert a.kv_table(0).num_released == 2 and bm.num_free_blocks == 6 and len(bm.evictable) == 2
    bm.release_out_of_window(a)  # idempotent
    assert a.kv_table(0).num_released == 2 and bm.num_free_blocks == 6
    b = _seq(list(range(8)) + [99, 98])
    assert bm.lookup_prefix(b) == a.block_table[:2]  # released, still a prefix hit
    bm.free(a)
    assert bm.num_free_blocks == 8 and all(blk.ref_count == 0 for blk in bm.blocks)
    assert a.kv_table(0).num_released == 0
    keep = BlockManager(num_blocks=8, block_size=4)  # no window: nothing is released
    c = _seq(list(range(14)))
    _run_to_computed(keep, c)
    keep.release_out_of_window(c)
    assert c.kv_table(0).num_released == 0 and keep.num_free_blocks == 4
