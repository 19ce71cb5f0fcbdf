"""Speculator: speculative decoding as one component of the step.

As in vLLM v1, drafts are proposed after a step for the next one (`propose`, into `seq.spec.tokens`);
the scheduler schedules them with the last real token, the runner scores and verifies them in one
pass, and `record` books the outcome: counters, the request's adapted k, whether it keeps speculating.
"""

from __future__ import annotations

from llmopt.engine.block_manager import BlockManager
from llmopt.engine.model_runner import ModelRunner
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.sequence import Sequence
from llmopt.engine.spec_decode.config import SpeculativeConfig
from llmopt.engine.spec_decode.model_proposer import ModelProposer
from llmopt.engine.spec_decode.ngram import NgramProposer
from llmopt.engine.spec_decode.state import SpecCounters


def spec_eligible(params: SamplingParams) -> bool:
    """Requests whose per-token processing depends on the previous token stay on the plain path, and so do
    biased ones (verification draws from the unbiased distribution)."""
    return (params.logprobs is None and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and params.min_tokens == 0 and not params.logit_bias)


class Speculator:
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner | None, draft_runner: ModelRunner | None,
                 num_layers: int, max_model_len: int, block_manager: BlockManager | None = None):
        """`block_manager` gives the draft passes of a model proposer their KV slots (prompt lookup needs none)."""
        self.config, self.max_model_len, self.block_manager = config, max_model_len, block_manager
        self.counters = SpecCounters(config.max_speculative_tokens or config.num_speculative_tokens)
        if config.method == "ngram":
            self.proposer: NgramProposer | ModelProposer = NgramProposer(config)
        elif config.method == "layer_skip":
            self.proposer = ModelProposer(runner, config.draft_layers or max(1, num_layers // 2))
        else:
            assert draft_runner is not None
            self.proposer = ModelProposer(draft_runner, None)

    def draft_len(self, seq: Sequence) -> int:
        """This request's current k: its adapted draft length, or the configured one until it adapts."""
        return seq.spec.k or self.config.num_speculative_tokens

    def propose(self, running: list[Sequence]) -> None:
        """After a step: drafts for the next one, for each running decode without any, unless the batch
        is too large to profit."""
        if len(running) > self.config.max_batch_size:
            self.counters.skipped_steps += 1
            return
        batch: list[tuple[Sequence, int]] = []
        for seq in running:
            if (seq.spec.tokens or seq.spec.disabled or seq.num_computed_tokens != seq.num_tokens - 1
                    or not spec_eligible(seq.params)):
                continue
            room = self.max_model_len - seq.num_tokens - 1
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
            k = min(self.draft_len(seq), room)
            if k <= 0:
                continue
            if self.proposer.writes_kv:  # draft passes write positions num_tokens-1 .. num_tokens+k-2
                if not self.block_manager.can_append(seq, k):
                    continue
                self.block_manager.append(seq, k)
            batch.append((seq, k))
        self.proposer.propose(batch)

    def discard(self, running: list[Sequence]) -> None:
        """Drop proposed drafts (speculation was turned off); the draft model's cache stays valid."""
        for seq in running:
            seq.spec.tokens = []
            seq.spec.draft_computed = min(seq.spec.draft_computed, seq.num_computed_tokens)

    def record(self, seq: Sequence, num_accepted: int) -> None:
        """Book a verified round and clear the sequence's drafts: counters, adapted k, dynamic disable."""
        st, c, cfg = seq.spec, self.counters, self.config
        num_drafts = len(st.tokens)
        st.tokens = []
        c.num_drafts += 1
        c.num_draft_tokens += num_drafts
        c.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            c.accepted_per_pos[i] += 1
        st.proposed += num_drafts
        st.accepted += num_accepted
        if cfg.max_speculative_tokens is not None and num_drafts:
            k = self.draft_len(seq)
            st.k = min(cfg.max_speculative_tokens, k + 2) if num_accepted == num_drafts else max(1, k - 1)
        if st.proposed >= cfg.disable_min_drafts and st.accepted < cfg.min_acceptance * st.proposed:
            st.disabled = True
            c.disabled_requests += 1
