"""SamplingParams: per-request decoding settings, mirroring vLLM's names and defaults."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmopt.engine.structured_output import StructuredOutputsParams


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)  # -1 or 0: disabled
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    max_tokens: int | None = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    # per prompt token: its logprob and the top-n alternatives, from the prefill (vLLM's prompt_logprobs);
    # such requests compute their whole prompt (no prefix-cache reuse), as in vLLM
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # token id -> bias added to its logit before sampling (OpenAI's logit_bias, -100..100)
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    # grammar-constrained decoding (vLLM's structured_outputs): a JSON schema, any JSON object, a regex, a
    # choice of strings or a grammar; the request ends ("stop") when the grammar is complete
    structured_outputs: StructuredOutputsParams | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v):
        return [] if v is None else [v] if isinstance(v, str) else v

    @field_validator("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        for tok, b in (v or {}).items():
            if tok < 0:
                raise ValueError("logit_bias token ids must not be negative")
            if not (math.isfinite(b) and -100.0 <= b <= 100.0):
                raise ValueError("logit_bias values must be between -100 and 100")
        return v or None

    @model_validator(mode="after")
    def _check(self):
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
