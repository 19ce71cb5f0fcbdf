"""Scenarios: the same workload and load, run on several *variants* of the offline engine, then compared.

A variant is data, not code: a name, a set of `EngineConfig` overrides and a batching mode. That is all
each optimization we want to measure needs:

* `static-vs-continuous`: one engine; `batching="static"` vs `"continuous"` at the same slot count.
* `prefix-cache`: `enable_prefix_caching` False vs True.
* `speculation`: no speculation vs n-gram prompt lookup.
* later, quantized vs baseline (`{"model": QUANT_DIR}` vs the original): a new entry in `SCENARIOS`
  with its overrides, nothing else changes.

The first variant is the baseline; the comparison divides every other variant's metrics by it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, Field

from llmopt.errors import LlmoptError

DEFAULT_STATIC_BATCH_SIZE = 8


class Variant(BaseModel):
    """One configuration of the offline engine to measure."""

    name: str
    description: str
    engine_overrides: dict[str, Any] = Field(default_factory=dict, description="EngineConfig fields to set.")
    batching: Literal["continuous", "static"] = "continuous"


class ScenarioParams(BaseModel):
    """Knobs that scenarios read; each scenario uses the ones it needs."""

    static_batch_size: int = Field(DEFAULT_STATIC_BATCH_SIZE, ge=1)


class Scenario(BaseModel):
    """A named list of variants; `variants[0]` is the baseline."""

    name: str
    description: str
    variants: list[Variant] = Field(min_length=2)
    default_workload: Literal["random", "prefix"] = "random"

    @property
    def baseline(self) -> Variant:
        return self.variants[0]


def _static_vs_continuous(p: ScenarioParams) -> Scenario:
    return Scenario(
        name="static-vs-continuous",
        description=(f"static batches of {p.static_batch_size} (the next batch starts when the whole batch has "
                     f"finished) vs continuous batching with {p.static_batch_size} slots (a freed slot is "
                     "refilled at the next step)"),
        variants=[
            Variant(name="static", batching="static",
                    description="fixed batches admitted together; each waits for its longest request"),
            Variant(name="continuous", batching="continuous",
                    description="a finished request's slot goes to the next request at the next step"),
        ],
    )


def _prefix_cache(p: ScenarioParams) -> Scenario:
    return Scenario(
        name="prefix-cache",
        description="automatic prefix caching off vs on (each measured run starts with an empty cache)",
        variants=[
            Variant(name="prefix-cache-off", engine_overrides={"enable_prefix_caching": False},
                    description="every prompt token is prefilled"),
            Variant(name="prefix-cache-on", engine_overrides={"enable_prefix_caching": True},
                    description="full prompt blocks seen before are reused from the KV cache"),
        ],
        default_workload="prefix",
    )


def _speculation(p: ScenarioParams) -> Scenario:
    return Scenario(
        name="speculation",
        description="speculative decoding off vs n-gram prompt lookup (k=4); greedy outputs are identical",
        variants=[
            Variant(name="spec-off", description="one token per sequence per step"),
            Variant(name="spec-ngram", engine_overrides={"speculative": {"method": "ngram",
                                                                         "num_speculative_tokens": 4}},
                    description="drafts from earlier occurrences in prompt + output, verified in one pass"),
        ],
    )


SCENARIOS: dict[str, Callable[[ScenarioParams], Scenario]] = {
    "static-vs-continuous": _static_vs_continuous,
    "prefix-cache": _prefix_cache,
    "speculation": _speculation,
}


def build_scenario(name: str, params: ScenarioParams | None = None) -> Scenario:
    """The scenario called `name`; a one-line LlmoptError lists the known ones otherwise."""
    factory = SCENARIOS.get(name)
    if factory is None:
        raise LlmoptError(f"unknown scenario {name!r}: choose from {', '.join(SCENARIOS)}")
    return factory(params or ScenarioParams())
