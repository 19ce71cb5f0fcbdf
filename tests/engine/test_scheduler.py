"""Scheduler on its own: token budget, chunked prefill, priorities, preemption and per-step counts."""

from __future__ import annotations

from llmopt.engine.block_manager import BlockManager
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.scheduler import Scheduler
from llmopt.engine.sequence import Sequence, SequenceStatus


def _seq(n: int, priority: int = 0) -> Sequence:
    return Sequence("r", 0, list(range(1, n + 1)), SamplingParams(), 0.0, priority)


def _computed(out) -> None:
    """What the engine's post-step update does for a plain step."""
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n


def test_a_long_prompt_is_chunked_under_the_token_budget():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=8)
    seq = _seq(20)
    sched.add(seq)
    sizes = []
    while seq.num_computed_tokens < seq.num_tokens:
        out = sched.schedule()
        sizes.append(out.num_batched_tokens)
        _computed(out)
    assert sizes == [8, 8, 4] and seq.status is SequenceStatus.RUNNING


def test_priority_policy_admits_the_lowest_value_first():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=1, max_num_batched_tokens=64, policy="priority")
    low, high = _seq(4, priority=5), _seq(4, priority=-1)
    sched.add(low)
    sched.add(high)
    assert [s for s, _ in sched.schedule().scheduled] == [high]
    high.priority = 10  # what LLMEngine.set_priority does; read at the next step
    assert sched.waiting == [low]


def test_an_exhausted_pool_preempts_the_last_running_sequence_and_requeues_it():
    bm = BlockManager(3, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _seq(4), _seq(4)
    sched.add(a)
    sched.add(b)
    _computed(sched.schedule())  # one block each
    a.token_ids.append(9)
    b.token_ids.append(9)
    out = sched.schedule()  # both need a second block, only one is free: b is preempted
    assert out.preempted == [b] and [s for s, _ in out.scheduled] == [a]
    assert sched.waiting[0] is b and b.num_computed_tokens == 0
    assert sched.take_num_preemptions() == 1 and sched.take_num_preemptions() == 0
    assert sched.num_preemptions == 1


def test_drafts_are_trimmed_to_the_budget():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=3)
    seq = _seq(4)
    sched.add(seq)
    out = sched.schedule()
    _computed(out)  # the prompt: 3 tokens this step
    out = sched.schedule()
    _computed(out)
    seq.token_ids.append(7)  # a decode with 4 drafts, but a budget of 3 tokens
    seq.spec.tokens = [1, 2, 3, 4]
    out = sched.schedule()
    assert out.scheduled == [(seq, 3)] and seq.spec.tokens == [1, 2]
