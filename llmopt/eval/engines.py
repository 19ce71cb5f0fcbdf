"""Build the LLM that an evaluation runs through, sized for scoring rather than serving.

The KV pool is sized from what the evaluation needs (one scoring batch, or a batch of generation prompts)
instead of the serving default (85% of free GPU memory, which `--bisect`'s second engine would not find).
Anything that goes wrong while loading becomes one `LlmoptError` line naming the model, so the CLI exits
2; `float32_notice` states what an upcast costs before it is paid.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field

from llmopt.devices import resolve_device
from llmopt.engine.config import EngineConfig
from llmopt.engine.llm import LLM
from llmopt.errors import LlmoptError

# tokens the pool holds besides one scoring batch: room for generation tasks' concurrent prompts, but never
# more than _GENERATION_KV_BYTES of KV (16k tokens of a 7B model without GQA would be 8 GiB in bf16)
_GENERATION_TOKENS = 16384
_GENERATION_KV_BYTES = 2 * 1024**3


class EngineOptions(BaseModel):
    """How each evaluated model is run (the same for baseline and candidate unless overridden)."""

    model_config = ConfigDict(extra="forbid")

    dtype: str = "auto"  # the checkpoint's own, as vLLM
    device: str = "auto"
    kv_cache_dtype: str = "auto"
    kv_cache_scales: str = "checkpoint"  # EngineConfig.kv_cache_scales
    max_batch_tokens: int = Field(4096, ge=2)
    max_model_len: int | None = Field(None, ge=2)  # None: the model's own limit (as lm-eval's HFLM)
    max_num_seqs: int = Field(64, ge=1)
    generation_tokens: int = Field(_GENERATION_TOKENS, ge=0)  # pool room for generate_until tasks (0: none)


def build_llm(model: str | None, opts: EngineOptions) -> LLM:
    """An LLM whose pool fits one scoring batch of `max_batch_tokens` and concurrent generation (an 8B
    model's 16k-token pool is 2 GB: only an eval with generation tasks asks for it)."""
    tokens = max(opts.max_batch_tokens, opts.max_model_len or 0, generation_tokens(model, opts))
    cfg = EngineConfig(model=model, dtype=opts.dtype, device=opts.device, kv_cache_dtype=opts.kv_cache_dtype,
                       kv_cache_scales=opts.kv_cache_scales,
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


def generation_tokens(model: str | None, opts: EngineOptions) -> int:
    """The pool's room for generation: `opts.generation_tokens`, capped at _GENERATION_KV_BYTES of this
    model's KV (fewer prompts then decode at once; the scheduler queues the rest)."""
    if not opts.generation_tokens:
        return 0
    from llmopt.models.loader import parse_dtype
    from llmopt.models.resolve import resolve_model

    try:
        spec = resolve_model(model).spec
        element = 1 if opts.kv_cache_dtype in ("int8", "fp8") else parse_dtype(
            opts.dtype, spec.dtype, resolve_device(opts.device)).itemsize
    except LlmoptError:
        return opts.generation_tokens  # a bad model or dtype is reported by the load, as one line
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * element
    return max(1, min(opts.generation_tokens, _GENERATION_KV_BYTES // per_token))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a loaded model's tensors as they sit in memory: parameters, buffers and the tensors modules
    keep as attributes (packed weights are neither; `state_dict()` would unpack them, a transient copy of
    the model). Shared storages count once."""
    seen: dict[int, int] = {}
    for mod in model.modules():
        for t in [*mod._parameters.values(), *mod._buffers.values(), *vars(mod).values()]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def float32_notice(model: str | None, dtype: str) -> str | None:
    """One line saying what float32 costs when it upcasts a smaller checkpoint, or None."""
    from llmopt.models.loader import parse_dtype
    from llmopt.models.resolve import resolve_model

    if dtype not in ("float32", "fp32"):
        return None
    resolved = resolve_model(model)
    stored = parse_dtype("auto", resolved.spec.dtype)
    if stored == torch.float32 or resolved.quantization_config is not None:
        return None
    gb = resolved.spec.num_params() * 4 / 1e9
    ratio = 4 // stored.itemsize
    return (f"{model or 'smollm2-135m'}: --dtype float32 holds its weights in about {gb:.1f} GB, {ratio}x its "
            f"{str(stored).removeprefix('torch.')} checkpoint (the default, auto, runs it as stored)")
