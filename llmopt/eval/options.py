"""EvalOptions: everything `llmopt eval` needs, validated once at the edge (CLI, recipe or Python)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmopt.eval.divergence import DEFAULT_TOP_K
from llmopt.eval.engines import EngineOptions


class EvalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # the candidate (alias, HF dir, quantized dir, .gguf)
    baseline: str | None = None
    ppl_data: Path | None = None
    seq_len: int = Field(2048, ge=2)
    stride: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=2)  # use only the first N tokens of the eval text
    tasks: list[Path] = []
    limit: int | None = Field(None, ge=1)
    harness: Literal["llmopt", "lm-eval"] = "llmopt"
    gates: list[str] = []
    dtype: str = "auto"  # the checkpoint's own dtype, as vLLM; float32 only when asked
    device: str = "auto"
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = "auto"
    # the candidate's calibrated KV scales, if it has them: run them, or per-token ones (EngineConfig's)
    kv_cache_scales: Literal["checkpoint", "dynamic"] = "checkpoint"
    baseline_dtype: str | None = None  # default: the candidate's dtype
    baseline_kv_cache_dtype: Literal["auto", "int8", "fp8"] = "auto"
    max_batch_tokens: int | None = Field(None, ge=2)
    kl_top_k: int = Field(DEFAULT_TOP_K, ge=1)  # baseline log-probs kept per token for KL (divergence.py)
    report: Path | None = None
    html: Path | None = None  # a self-contained HTML page (llmopt.eval.html_report)
    bisect: bool = False
    bisect_plot: Path | None = None

    @model_validator(mode="after")
    def _check(self) -> EvalOptions:
        if self.ppl_data is None and not self.tasks:
            raise ValueError("give --ppl-data and/or at least one --task")
        if self.bisect and (self.baseline is None or self.ppl_data is None):
            raise ValueError("--bisect needs --baseline and --ppl-data")
        if self.bisect_plot is not None and not self.bisect:
            raise ValueError("--bisect-plot draws the --bisect table; add --bisect (no plot was written without it)")
        if self.stride is not None and self.stride > self.seq_len:
            raise ValueError(f"--stride {self.stride} must not exceed --seq-len {self.seq_len}")
        return self

    @field_validator("dtype", "baseline_dtype")
    @classmethod
    def _dtype(cls, v: str | None) -> str | None:
        allowed = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "auto")
        if v is not None and v not in allowed:
            raise ValueError(f"dtype must be one of {', '.join(allowed)}")
        return v

    def engine_options(self, batch_tokens: int, baseline: bool = False, generation: bool = True) -> EngineOptions:
        """Engine settings of the candidate (or the baseline: its own dtype/KV dtype when given); without
        `generation` (no generate_until task) the KV pool holds one scoring batch only."""
        return EngineOptions(
            dtype=(self.baseline_dtype or self.dtype) if baseline else self.dtype,
            device=self.device,
            kv_cache_dtype=self.baseline_kv_cache_dtype if baseline else self.kv_cache_dtype,
            kv_cache_scales="checkpoint" if baseline else self.kv_cache_scales,
            max_batch_tokens=max(batch_tokens, self.seq_len),
            **({} if generation else {"generation_tokens": 0}),
        )
