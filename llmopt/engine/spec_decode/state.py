"""Speculation state: one object per sequence, and the engine-wide counters (vLLM's spec_decode_*)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecState:
    """One sequence's speculation: this step's drafts and the request's running acceptance."""

    tokens: list[int] = field(default_factory=list)  # drafts scored this step (placeholders until filled)
    proposed: int = 0
    accepted: int = 0
    disabled: bool = False  # acceptance fell below the threshold: this request decodes plainly
    k: int = 0  # this request's current draft length (0: the configured k)
    draft_computed: int = 0  # tokens whose K/V the separate draft model has cached (method "draft")


@dataclass
class SpecCounters:
    """Cumulative speculative-decoding counts, named after vLLM's spec_decode_* metrics."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    disabled_requests: int = 0
    skipped_steps: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    _reported: tuple[int, int, int] = (0, 0, 0)

    def __post_init__(self):
        self.accepted_per_pos = [0] * self.k

    def take(self) -> tuple[int, int, int]:
        """(drafts, draft tokens, accepted tokens) since the previous call: one step's share."""
        d0, t0, a0 = self._reported
        self._reported = (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)
        return self.num_drafts - d0, self.num_draft_tokens - t0, self.num_accepted_tokens - a0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verification step (accepted drafts + the target's own token)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
