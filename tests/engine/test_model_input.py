"""ModelRunner.prepare on its own: the layout of a mixed step and the rows each consumer reads."""

from __future__ import annotations

from llmopt import LLM
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.sequence import Sequence


def test_prefill_chunks_come_first_then_decodes_by_decreasing_context(tiny_llama):
    eng = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=16, block_size=4).engine
    bm = eng.block_manager
    whole = Sequence("a", 0, list(range(3, 9)), SamplingParams(), 0.0)  # a whole prompt: 6 tokens
    part = Sequence("b", 0, list(range(3, 13)), SamplingParams(prompt_logprobs=0), 0.0)  # first chunk only
    short = Sequence("c", 0, [5, 6, 7], SamplingParams(), 0.0)  # decodes: 2 and 4 tokens cached
    long = Sequence("d", 0, [5, 6, 7, 8, 9], SamplingParams(), 0.0)
    for seq, n in ((whole, 6), (part, 10), (short, 3), (long, 5)):
        bm.allocate(seq, [], n)
    short.num_computed_tokens, long.num_computed_tokens = 2, 4
    inp = eng.runner.prepare([(short, 1), (whole, 6), (long, 1), (part, 4)])
    assert inp.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 2]
    assert inp.input_ids.tolist() == list(range(3, 9)) + [3, 4, 5, 6] + [9, 7]
    assert inp.num_prefill_tokens == 10 and inp.num_decode_tokens == 2
    # sampled rows end a sequence's known tokens: `part`'s chunk does not, so it is not sampled
    assert inp.logits_indices == [5, 10, 11] and inp.sample_seqs == [whole, long, short]
    assert inp.prompt_rows == [(part, 6, 0, 4)]  # its chunk's rows score prompt tokens 1..4
    bs = 4
    expect = [whole.block_table[p // bs] * bs + p % bs for p in range(6)]
    expect += [part.block_table[p // bs] * bs + p % bs for p in range(4)]
    expect += [long.block_table[1] * bs + 0, short.block_table[0] * bs + 2]
    assert inp.slot_mapping.tolist() == expect
    assert len(inp.attn_metadata.prefills) == 2 and len(inp.attn_metadata.decode_groups) == 1
    for seq in (whole, part, short, long):
        bm.free(seq)


def test_a_speculating_sequence_has_a_row_per_scored_position(tiny_llama):
    eng = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=8, block_size=4).engine
    seq = Sequence("a", 0, [3, 4, 5, 6], SamplingParams(temperature=0), 0.0)
    eng.block_manager.allocate(seq, [], 7)
    seq.num_computed_tokens = 3
    seq.spec.tokens = [7, 8, 9]
    inp = eng.runner.prepare([(seq, 4)])
    assert inp.input_ids.tolist() == [6, 7, 8, 9] and inp.positions.tolist() == [3, 4, 5, 6]
    assert inp.spec_rows == [(seq, [0, 1, 2, 3])] and inp.logits_indices == [] and inp.sample_seqs == []
    eng.block_manager.free(seq)
