"""What an A/B benchmark compares: two sides, each the command line's target with a few settings changed.

A side is written `KEY=VALUE[,KEY=VALUE...]` over the flags the command line already has, so anything a
plain benchmark can target can be one side: two servers (`url=http://h:8000` and `url=http://h:8001`),
two models or checkpoints (`model=smollm2-135m`, `model=out/w4`), or two engine settings
(`max-num-seqs=1`, `max-num-seqs=8`). A bare URL or model is short for `url=` or `model=`. `name=`
labels the side in tables (default `A` and `B`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmopt.bench.http_target import HttpTargetConfig
from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError

AbOrder = Literal["abba", "abab"]
DEFAULT_AB_ROUNDS = 6

# spec key -> (BenchOptions field, value type)
SIDE_KEYS: dict[str, tuple[str, type]] = {
    "url": ("url", str),
    "model": ("model", str),
    "served-model": ("served_model", str),
    "api-key": ("api_key", str),
    "dtype": ("dtype", str),
    "device": ("device", str),
    "max-num-seqs": ("max_num_seqs", int),
    "max-num-batched-tokens": ("max_num_batched_tokens", int),
    "kv-cache-memory": ("kv_cache_memory", str),
    "kv-cache-dtype": ("kv_cache_dtype", str),
    "prefix-caching": ("prefix_caching", bool),
    "threads": ("threads", str),
    "name": ("name", str),
}
_BOOL = {"on": True, "true": True, "1": True, "yes": True, "off": False, "false": False, "0": False, "no": False}


def parse_side(text: str) -> dict[str, Any]:
    """`max-num-seqs=8,name=batched` -> {"max_num_seqs": 8, "name": "batched"}; bare URL/model allowed."""
    s = text.strip()
    if not s:
        raise LlmoptError("empty --ab side: give KEY=VALUE pairs, a URL or a model")
    if "=" not in s:
        return {"url": s} if s.startswith(("http://", "https://")) else {"model": s}
    out: dict[str, Any] = {}
    for item in s.split(","):
        key, sep, value = (x.strip() for x in item.partition("="))
        key = key.replace("_", "-").lower()
        if not sep or not value:
            raise LlmoptError(f"cannot parse --ab side {text!r}: {item!r} is not KEY=VALUE")
        if key not in SIDE_KEYS:
            raise LlmoptError(f"unknown --ab key {key!r} in {text!r}: use {', '.join(SIDE_KEYS)}")
        field, kind = SIDE_KEYS[key]
        if kind is int:
            try:
                out[field] = int(value)
            except ValueError:
                raise LlmoptError(f"--ab {key} must be a whole number, got {value!r}") from None
        elif kind is bool:
            if value.lower() not in _BOOL:
                raise LlmoptError(f"--ab {key} must be on or off, got {value!r}")
            out[field] = _BOOL[value.lower()]
        else:
            out[field] = value
    return out


class AbSide(BaseModel):
    """One side: a server or an in-process engine configuration."""

    model_config = ConfigDict(extra="forbid")

    name: str
    spec: str = Field(description="The --ab text it was built from.")
    http: HttpTargetConfig | None = None
    engine: EngineConfig | None = None


class AbConfig(BaseModel):
    """Two sides, how many rounds, in which order; ratios are B / A."""

    model_config = ConfigDict(extra="forbid")

    sides: list[AbSide] = Field(min_length=2, max_length=2)
    rounds: int = Field(DEFAULT_AB_ROUNDS, ge=2)
    order: AbOrder = "abba"
    confidence: float = Field(0.95, gt=0.5, lt=1.0, description="Level of the reported intervals.")

    @model_validator(mode="after")
    def _check(self) -> AbConfig:
        a, b = self.sides
        if (a.http is None) != (b.http is None):
            raise LlmoptError("--ab compares like with like: two servers (url=) or two in-process engines")
        if a.name == b.name:
            raise LlmoptError(f"the two --ab sides need different names, both are {a.name!r}")
        return self

    def sequence(self, round_index: int) -> tuple[int, int]:
        """Which side runs first in a round: always A with `abab`; A then B, B then A, ... with `abba`."""
        return (1, 0) if self.order == "abba" and round_index % 2 else (0, 1)
