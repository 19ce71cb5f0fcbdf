"""SpeculativeConfig: which proposer, how many draft tokens, and when speculation is not worth it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram", "layer_skip", "draft"] = "ngram"
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    # each request adapts its k between 1 and this, as transformers' assisted generation does: +2 after
    # a round whose drafts were all accepted, -1 after a rejection. None keeps k fixed.
    max_speculative_tokens: int | None = Field(None, ge=1, le=16)
    # draft: the draft model (alias, HF dir, .gguf or an llmopt-quantized checkpoint) and its dtype
    draft_model: str | None = None
    draft_dtype: str = "auto"
    # layer_skip: the target's first `draft_layers` layers + its head draft greedily (default: half)
    draft_layers: int | None = Field(None, ge=1)
    prompt_lookup_min: int = Field(2, ge=1)
    prompt_lookup_max: int = Field(5, ge=1)
    # a request stops speculating once it has proposed `disable_min_drafts` tokens at an acceptance rate
    # below this (default 0.3; 0.7 for `draft`, whose drafts each cost a draft-model forward, BENCHMARKS)
    disable_below_acceptance: float | None = Field(None, ge=0.0, le=1.0)
    disable_min_drafts: int = Field(16, ge=1)
    # no speculation in steps with more running sequences than this (verification would cost more)
    max_batch_size: int = Field(8, ge=1)

    @property
    def min_acceptance(self) -> float:
        """The acceptance rate below which a request stops speculating."""
        default = 0.7 if self.method == "draft" else 0.3
        return default if self.disable_below_acceptance is None else self.disable_below_acceptance

    @model_validator(mode="after")
    def _draft(self) -> SpeculativeConfig:
        if self.max_speculative_tokens is not None and self.max_speculative_tokens < self.num_speculative_tokens:
            raise ValueError("max_speculative_tokens must be at least num_speculative_tokens")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model (a model with the target's tokenizer)")
        if self.draft_model and self.method != "draft":
            raise ValueError(f"draft_model is only used by method 'draft', not {self.method!r}")
        return self
