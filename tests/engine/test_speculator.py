"""The Speculator on its own (prompt lookup): which sequences get drafts after a step, and what a verified
round books."""

from __future__ import annotations

from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.sequence import Sequence
from llmopt.engine.spec_decode import SpeculativeConfig
from llmopt.engine.spec_decode.speculator import Speculator


def _decode(ids: list[int], **params) -> Sequence:
    seq = Sequence("r", 0, ids, SamplingParams(temperature=0, **params), 0.0)
    seq.num_computed_tokens = len(ids) - 1  # a decode: only the newest token lacks its K/V
    return seq


def _speculator(**cfg) -> Speculator:
    config = SpeculativeConfig(method="ngram", prompt_lookup_min=1, prompt_lookup_max=3, **cfg)
    return Speculator(config, runner=None, draft_runner=None, num_layers=2, max_model_len=64)


def test_propose_drafts_only_for_eligible_decodes_within_their_room():
    spec = _speculator(num_speculative_tokens=4)
    plain = _decode([1, 2, 3, 1, 2])
    short = _decode([1, 2, 3, 1, 2], max_tokens=2)  # room for max_tokens - 1 drafts
    logprobs = _decode([1, 2, 3, 1, 2], logprobs=1)  # per-token processing: stays plain
    prefill = _decode([1, 2, 3, 1, 2])
    prefill.num_computed_tokens = 0
    spec.propose([plain, short, logprobs, prefill])
    assert plain.spec.tokens == [3, 1, 2, 3]
    assert short.spec.tokens == [3]
    assert logprobs.spec.tokens == [] and prefill.spec.tokens == []


def test_a_batch_above_max_batch_size_skips_the_step():
    spec = _speculator(max_batch_size=1)
    seqs = [_decode([1, 2, 1]), _decode([1, 2, 1])]
    spec.propose(seqs)
    assert all(s.spec.tokens == [] for s in seqs) and spec.counters.skipped_steps == 1


def test_drafts_are_kept_until_verified_and_dropped_by_discard():
    """A sequence a step left out keeps its drafts (it is not proposed for again); turning speculation
    off drops them, and the draft model's cache is trusted only up to the last real token."""
    spec = _speculator()
    a, b = _decode([1, 2, 1]), _decode([4, 5, 4])
    spec.propose([a, b])
    kept = list(b.spec.tokens)
    b.token_ids.append(7)  # were b proposed for again, its drafts would follow the new suffix
    b.num_computed_tokens += 1
    spec.propose([b])
    assert kept and b.spec.tokens == kept
    a.spec.draft_computed = a.num_tokens + 2  # a draft model cached its drafts too
    spec.discard([a, b])
    assert a.spec.tokens == [] and b.spec.tokens == [] and a.spec.draft_computed == a.num_computed_tokens


def test_record_counts_adapts_k_and_disables_a_poor_request():
    spec = _speculator(num_speculative_tokens=2, max_speculative_tokens=6, disable_min_drafts=4,
                       disable_below_acceptance=0.5)
    seq = _decode([1, 2, 1])
    seq.spec.tokens = [2, 1]
    spec.record(seq, 2)  # all accepted: k grows by 2
    assert seq.spec.tokens == [] and seq.spec.k == 4
    c = spec.counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (1, 2, 2) and c.accepted_per_pos[:2] == [1, 1]
    assert c.take() == (1, 2, 2) and c.take() == (0, 0, 0)
    seq.spec.tokens = [5, 5, 5, 5]
    spec.record(seq, 0)  # a rejection: k shrinks by 1; 2 of 6 accepted is below half: disabled
    assert seq.spec.k == 3 and seq.spec.disabled and c.disabled_requests == 1
    spec.propose([seq])
    assert seq.spec.tokens == []


def test_discard_clamps_every_sequence_draft_cache():
    """A sequence whose drafts the budget trimmed away holds none but its draft model may have cached
    guesses past the last real token: discard clamps it too."""
    spec = _speculator()
    a = _decode([1, 2, 1])
    a.spec.draft_computed = a.num_tokens + 3  # guesses cached, drafts already gone
    spec.discard([a])
    assert a.spec.draft_computed == a.num_computed_tokens
