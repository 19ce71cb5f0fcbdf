"""Build the LLM that an evaluation runs through, sized for scoring rather than serving.

Eval may hold two engines (baseline and candidate) at once, so the KV pool is sized from what the
evaluation needs (one scoring batch, or a batch of generation prompts) instead of the serving default
(85% of free GPU memory would leave nothing for the second engine). Anything that goes wrong while
loading becomes one `LlmoptError` line naming the model, so the CLI exits 2.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from llmopt.engine.config import EngineConfig
from llmopt.engine.llm import LLM
from llmopt.errors import LlmoptError

# tokens the pool holds besides one scoring batch: room for generation tasks' concurrent prompts
_GENERATION_TOKENS = 16384


class EngineOptions(BaseModel):
    """How each evaluated model is run (the same for baseline and candidate unless overridden)."""

    model_config = ConfigDict(extra="forbid")

    dtype: str = "float32"
    device: str = "auto"
    kv_cache_dtype: str = "auto"
    max_batch_tokens: int = Field(4096, ge=2)
    max_model_len: int | None = Field(None, ge=2)  # None: the model's own limit (as lm-eval's HFLM)
    max_num_seqs: int = Field(64, ge=1)


def build_llm(model: str | None, opts: EngineOptions) -> LLM:
    """An LLM whose pool fits one scoring batch of `max_batch_tokens` and concurrent generation."""
    tokens = max(opts.max_batch_tokens, opts.max_model_len or 0, _GENERATION_TOKENS)
    cfg = EngineConfig(model=model, dtype=opts.dtype, device=opts.device, kv_cache_dtype=opts.kv_cache_dtype,
                       max_num_batched_tokens=max(opts.max_batch_tokens, 2048), max_num_seqs=opts.max_num_seqs,
                       num_kv_blocks=math.ceil(tokens / 16) + 1, block_size=16,
                       max_model_len=opts.max_model_len, enable_prefix_caching=True)
    try:
        return LLM(**cfg.model_dump())
    except LlmoptError:
        raise
    except Exception as e:  # corrupt safetensors, unsupported layout, OOM: one line, exit 2
        first = str(e).splitlines()[0] if str(e) else repr(e)
        raise LlmoptError(f"cannot load model {model or 'smollm2-135m'!r}: {type(e).__name__}: {first}") from None
