"""EngineConfig: every knob of the engine, validated once at the edge (CLI, server, recipe, Python)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmopt.engine.spec_decode import SpeculativeConfig
from llmopt.units import parse_bytes

COMMAND_DEFAULT = "auto"  # the thread count generate / serve / bench run with unless --threads says otherwise


def parse_threads(v: object) -> int | str | None:
    """A thread count as configs and flags give it (3, "3", "auto", None); ValueError otherwise."""
    if v is None or v == "auto":
        return v
    try:
        n = int(v)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        n = 0
    if isinstance(v, bool) or n < 1 or (isinstance(v, float) and v != n):
        raise ValueError(f"threads must be a positive count or auto, got {v!r}")
    return n


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # alias, HF dir or .gguf; None = the embedded SmolLM2-135M
    dtype: Literal["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half"] = "auto"
    device: str = "auto"  # auto|cpu|cuda|cuda:N
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    block_size: int = Field(16, ge=1)
    kv_cache_memory: int | None = None  # bytes for the KV pool
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = "auto"
    # a checkpoint's calibrated KV scales (`quantize --kv-cache int8|fp8`): "checkpoint" runs them (the static
    # numerics vLLM reads); "dynamic" scales each token and head by its own absmax instead, which cost less
    # perplexity or tied in every measurement (docs/QUANTIZE.md "KV cache at 2k tokens") at the same pool size
    kv_cache_scales: Literal["checkpoint", "dynamic"] = "checkpoint"
    # True: plain eager torch: no TorchInductor, no packed weights (llmopt.layers.packed_linear) and none
    # of our C kernels (llmopt.native)
    enforce_eager: bool = False
    # "native": bf16 CPU decode steps run every layer in one native call (llmopt.step); "eager": layer by
    # layer in Python (the same kernels, the same output bits)
    decode_step: Literal["native", "eager"] = "native"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    seed: int = 0
    # CPU threads: a count, "auto" (the cores other processes leave free, followed while running:
    # llmopt.engine.threads), or None to keep the process's torch setting
    num_threads: int | Literal["auto"] | None = None
    speculative: SpeculativeConfig | None = None  # a dict such as {"method": "ngram"} is accepted

    @field_validator("num_threads", mode="before")
    @classmethod
    def _threads(cls, v):
        return parse_threads(v)

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _mem(cls, v):
        return None if v is None else parse_bytes(v)
