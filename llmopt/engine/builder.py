"""Builds an engine's parts from its config, once: model, tokenizer, draft model, KV pool, scheduler."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from llmopt.devices import resolve_device
from llmopt.engine.block_manager import BlockManager
from llmopt.engine.config import EngineConfig
from llmopt.engine.hybrid_block_manager import HybridBlockManager
from llmopt.engine.model_runner import ModelRunner
from llmopt.engine.scheduler import Scheduler
from llmopt.engine.structured_output import StructuredOutputCompiler
from llmopt.engine.threads import ThreadPolicy
from llmopt.errors import LlmoptError
from llmopt.layers.attention import GroupedKVCache, PagedKVCache, get_backend
from llmopt.loading.formats import kv_cache_scales
from llmopt.loading.load import load_model
from llmopt.models.base import CausalLM
from llmopt.models.loader import parse_dtype
from llmopt.models.resolve import ResolvedModel, resolve_model, weights_dir
from llmopt.models.spec import ModelSpec
from llmopt.models.tokenizer import load_tokenizer
from llmopt.quant.linear import use_native_int8_kernel

DEFAULT_CPU_KV_MEMORY = 2 * 1024**3


@dataclass
class EngineParts:
    resolved: ResolvedModel
    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    model: CausalLM
    weights_dir: Path  # the checkpoint's files (tokenizer, generation_config.json)
    tokenizer: object
    eos_token_ids: list[int]
    structured_outputs: StructuredOutputCompiler
    kv_cache: PagedKVCache | GroupedKVCache
    kv_cache_bytes: int
    num_blocks: int
    max_model_len: int
    block_manager: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    draft_runner: ModelRunner | None  # speculative method "draft": the draft model over its own pool
    threads: ThreadPolicy


def build_engine(config: EngineConfig) -> EngineParts:
    threads = ThreadPolicy(config.num_threads)
    torch.manual_seed(config.seed)
    resolved = resolve_model(config.model)
    s = resolved.spec
    device = resolve_device(config.device)
    dtype = parse_dtype(config.dtype, s.dtype, device)
    model = load_model(resolved, dtype, device, pack=not config.enforce_eager)  # packed as each layer lands
    wdir = weights_dir(resolved)
    tokenizer = load_tokenizer(wdir)
    eos = eos_ids(wdir, tokenizer, s.eos_token_id)
    # structured outputs: compiles each constraint once (thread-safe: servers compile at the edge too)
    structured = StructuredOutputCompiler(tokenizer, s.vocab_size, eos)
    # a checkpoint with calibrated KV scales (llmopt quantize --kv-cache int8|fp8) defaults to that cache
    kv_scales = kv_cache_scales(resolved)
    kv_dtype = kv_scales.dtype if kv_scales is not None and config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    attn = get_backend(device, config.block_size, not config.enforce_eager)
    sc = config.speculative
    draft, draft_dtype, draft_bytes = None, None, 0
    if sc is not None and sc.method == "draft":
        draft, draft_dtype = _load_draft(sc.draft_model, sc.draft_dtype, s, tokenizer, device, not config.enforce_eager)
        ds = draft.spec  # the draft's pool mirrors the target's (group 0) block for block
        draft_bytes = attn.bytes_per_block(ds.num_layers, ds.num_kv_heads, ds.head_dim, draft_dtype)
    if config.enforce_eager:  # int8 weights on torch's kernel, not ours (otherwise packed while loading)
        for m in [m for m in (model, draft) if m is not None]:
            use_native_int8_kernel(m, False)
    kv_cache, block_manager, num_blocks, kv_bytes = _kv_pool(config, s, device, attn, dtype, kv_dtype, draft_bytes,
                                                             draft is not None)
    static = kv_scales is not None and kv_dtype == kv_scales.dtype and config.kv_cache_scales == "checkpoint"
    if static and kv_cache.quantized:
        kv_cache.set_static_scales(kv_scales.k_scale, kv_scales.v_scale)
    max_len = min(config.max_model_len or s.max_position_embeddings, s.max_position_embeddings)
    max_model_len = min(max_len, num_blocks * config.block_size)
    scheduler = Scheduler(block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                          config.enable_chunked_prefill, config.scheduling_policy)
    native = config.decode_step == "native"
    runner = ModelRunner(model, kv_cache, attn, native)
    draft_runner = None if draft is None else ModelRunner(
        draft, attn.make_cache(ds.num_layers, num_blocks, ds.num_kv_heads, ds.head_dim, draft_dtype), attn, native)
    return EngineParts(resolved, s, device, dtype, model, wdir, tokenizer, eos, structured, kv_cache,
                       kv_bytes, num_blocks, max_model_len, block_manager, scheduler, runner, draft_runner, threads)


def _kv_pool(c: EngineConfig, s: ModelSpec, device: torch.device, attn, dtype: torch.dtype, kv_dtype: str,
             draft_bytes: int, has_draft: bool):
    """(cache, block manager, group 0's blocks, bytes). One pool, or for a model mixing full and sliding
    layers one per KV group, each sliding one sized for max_num_seqs windows plus a step's tokens."""
    groups = s.kv_groups
    bs = c.block_size
    sizes = [attn.bytes_per_block(len(layers), s.num_kv_heads, s.head_dim, dtype, kv_dtype) for _, layers in groups]
    sizes[0] += draft_bytes
    if len(groups) == 1:
        n = _num_blocks(c, s, device, sizes[0])
        # blocks out of every layer's window go back to the pool; not with a separate draft model, whose
        # catch-up may start earlier and whose own layers may attend to everything
        release = None if has_draft else groups[0][0]
        cache = attn.make_cache(s.num_layers, n, s.num_kv_heads, s.head_dim, dtype, kv_dtype)
        cache.windows = [groups[0][0]]
        return cache, BlockManager(n, bs, c.enable_prefix_caching, release), n, sizes[0] * n
    caps = [c.max_num_seqs * (-(-w // bs) + 2) + -(-c.max_num_batched_tokens // bs) for w, _ in groups[1:]]
    sliding_bytes = sum(cap * size for cap, size in zip(caps, sizes[1:], strict=True))
    try:
        n0 = _num_blocks(c, s, device, sizes[0], reserved=sliding_bytes)
    except LlmoptError:  # the sliding pools' caps alone exceed the memory
        n0 = 0
    if n0 < max(caps) and not c.num_kv_blocks:  # too little memory for the caps: equal block counts
        n0 = _num_blocks(c, s, device, sum(sizes))
    counts = [n0] + [min(n0, cap) for cap in caps]
    cache = attn.make_grouped_cache([list(layers) for _, layers in groups], counts, s.num_kv_heads, s.head_dim,
                                    dtype, kv_dtype, [w for w, _ in groups])
    managers = [BlockManager(n, bs, c.enable_prefix_caching, w, group=g)
                for g, ((w, _), n) in enumerate(zip(groups, counts, strict=True))]
    managers[0].release_window = None  # group 0 keeps every block (a draft model mirrors its tables)
    manager = HybridBlockManager(managers[0], managers[1:])
    return cache, manager, n0, sum(n * size for n, size in zip(counts, sizes, strict=True))


def _load_draft(name: str, requested_dtype: str, target: ModelSpec, tokenizer,
                device: torch.device, pack: bool) -> tuple[CausalLM, torch.dtype]:
    """The separate draft model and the dtype it runs in; it must share the target's tokenizer."""
    resolved = resolve_model(name)
    if resolved.spec.vocab_size != target.vocab_size:
        raise LlmoptError(f"draft model {name!r} has a vocabulary of {resolved.spec.vocab_size} tokens, "
                          f"the target {target.vocab_size}: speculative decoding needs the same tokenizer")
    dtok = load_tokenizer(weights_dir(resolved))
    if dtok.get_vocab() != tokenizer.get_vocab():
        raise LlmoptError(f"draft model {name!r} does not use the target's tokenizer")
    dtype = parse_dtype(requested_dtype, resolved.spec.dtype, device)
    return load_model(resolved, dtype, device, pack=pack), dtype


def _num_blocks(c: EngineConfig, spec: ModelSpec, device: torch.device, per_block: int, reserved: int = 0) -> int:
    """Blocks: as configured, else what memory allows (less `reserved` bytes), capped at what
    max_num_seqs full-length sequences use."""
    if c.num_kv_blocks:
        return c.num_kv_blocks
    if c.kv_cache_memory is not None:
        n = (c.kv_cache_memory - reserved) // per_block
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        n = int(free * 0.85 - 1024**3 - reserved) // per_block
    else:
        n = (DEFAULT_CPU_KV_MEMORY - reserved) // per_block
    if c.kv_cache_memory is None:
        max_len = min(c.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
        n = min(n, c.max_num_seqs * -(-max_len // c.block_size))
    if n < 1:
        raise LlmoptError(f"KV cache memory is too small for one block of {c.block_size} tokens "
                          f"({per_block} bytes)")
    return int(n)


def eos_ids(directory, tokenizer, spec_eos: list[int]) -> list[int]:
    """End-of-sequence ids from the model spec, generation_config.json and the tokenizer."""
    gen = directory / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    ids = [*spec_eos, *(eos if isinstance(eos, list) else [eos]), tokenizer.eos_token_id]
    return sorted({int(i) for i in ids if i is not None})
