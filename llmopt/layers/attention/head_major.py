"""The head-major backend over `PagedKVCache` ([heads, slots, head_dim] per layer): the CPU path, any device.

A step's tokens are its prefill chunks, then its decodes. A prefill chunk runs SDPA with a causal mask offset
by its cached prefix (or the compiled `causal_attention`; on a CPU with AMX tiles, the AMX kernel of
prefill_attention.c; SDPA in float32 on a CPU with no matmul for its 16-bit dtype, `prefill_dtype`); decodes run
in groups of similar context length (bf16 or float32 on a CPU: the paged decode kernel; else one block gather + one
SDPA each). A sliding layer's table
entries for blocks that left the window point at a placeholder block (read, masked; the kernel skips them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import llmopt.native as native
from llmopt.devices import onednn_supported
from llmopt.layers import kernels
from llmopt.layers.attention.backend import AttentionBackend, DecodeItem, PrefillItem
from llmopt.layers.attention.head_major_metadata import DecodeGroup, HeadMajorMetadata, PrefillChunk
from llmopt.layers.attention.layer import PagedAttention
from llmopt.layers.attention.paged_decode_kernel import PagedDecodeKernel
from llmopt.layers.attention.paged_decode_kernel import load as load_decode_kernel
from llmopt.layers.attention.paged_kv_cache import PagedKVCache
from llmopt.layers.attention.prefill_attention_kernel import PrefillAttentionKernel
from llmopt.layers.attention.prefill_attention_kernel import load as load_prefill_kernel
from llmopt.layers.attention.prefill_attention_kernel import runs_here as prefill_kernel_runs_here
from llmopt.layers.kernels import Ops

NO_WINDOW = 1 << 40  # a full layer's window for the compiled prefill function (no position is that far back)
MIN_DECODE_GROUP = 8  # sequences; smaller groups are merged into the previous (longer) one
# past this many query x context positions a chunk uses SDPA, which streams what `causal_attention` holds. With
# AMX tiles (amx_bf16), torch's SDPA is 3-12x faster than the compiled function at every size (16 to 2,048
# tokens, docs/BENCHMARKS.md "AMX"), so such a CPU always uses SDPA; so does a CPU without bf16 matmuls (AVX2
# only), where prefill attention runs in float32 and SDPA was 1.8-4.4x faster (64 to 2,048 tokens, Zen 3).
COMPILED_ATTENTION_MAX_SCORES = 2048 * 4096
# prefill chunks run prefill_attention.c on AMX tiles (1.1-2.7x torch's flash SDPA, docs/BENCHMARKS.md "Prefill
# attention on AMX tiles"), or in its float32 FMAs on Intel cores without AMX ("Prefill attention in float32 FMAs"),
# over their own K/V or a cached context gathered (and dequantized) from the pool
AMX_PREFILL = native.cpu_has("amx_bf16")
KERNEL_PREFILL = prefill_kernel_runs_here()


def prefill_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What a prefill chunk's attention multiplies in: its own dtype, but float32 for 16-bit inputs on a CPU whose
    oneDNN has no matmul for them (AVX2-only CPUs: torch's bf16 matmul ran 10x slower there than float32, and the
    compiled attention was 78% of a 1,024-token SmolLM2 prefill; docs/BENCHMARKS.md, "the AVX2 passes")."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16) or onednn_supported(dtype):
        return dtype
    return torch.float32


def compiled_attention_max_scores(device: torch.device) -> int:
    """COMPILED_ATTENTION_MAX_SCORES, or 0 (SDPA at every size) on the CPUs named there."""
    if device.type == "cpu" and (AMX_PREFILL or not onednn_supported(torch.bfloat16)):
        return 0
    return COMPILED_ATTENTION_MAX_SCORES


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, offset: int,
                     window: int = 0) -> torch.Tensor:
    """q [L, H, D] at positions offset..offset+L-1; k, v [Hkv, C, D] at positions 0..C-1. Returns [L, H*D].
    `window` > 0: each query sees only the last `window` positions (itself included). Query heads sharing a
    KV head are stacked into one matrix: two matmuls around a masked softmax, which TorchInductor fuses."""
    length, h, d = q.shape
    hkv = k.shape[0]
    qg = q.transpose(0, 1).reshape(hkv, (h // hkv) * length, d)  # rows: (head in group, position)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [Hkv, G*L, C]
    q_pos = torch.arange((h // hkv) * length, device=q.device) % length + offset
    k_pos = torch.arange(k.shape[1], device=q.device).unsqueeze(0)
    allowed = k_pos <= q_pos.unsqueeze(1)
    if window > 0:
        allowed = allowed & (k_pos > q_pos.unsqueeze(1) - window)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [Hkv, G*L, D]
    return out.view(h, length, d).transpose(0, 1).reshape(length, h * d)


class HeadMajorBackend(AttentionBackend):
    name = "head_major"
    _kernel: PagedDecodeKernel | None | bool = False  # False: not loaded yet
    _prefill_kernel: PrefillAttentionKernel | None | bool = False

    def decode_kernel(self, q: torch.Tensor, pool: PagedKVCache, layer: PagedAttention) -> PagedDecodeKernel | None:
        """The paged decode kernel when it takes this layer's decodes: bf16 on a CPU (over a bf16, int8 or
        fp8 pool) or float32 (over a float32 pool), not `enforce_eager` (which keeps SDPA over a gather)."""
        if (not self.allow_compiled
                or not PagedDecodeKernel.supports(q, pool.k, layer.num_heads, layer.num_kv_heads)):
            return None
        if self._kernel is False:
            self._kernel = load_decode_kernel()
        return self._kernel

    def prefill_kernel(self, q: torch.Tensor, k: torch.Tensor, layer: PagedAttention) -> PrefillAttentionKernel | None:
        """The prefill attention kernel when it takes this layer's chunk: a CPU it runs on (`KERNEL_PREFILL`),
        bf16, not `enforce_eager` (which keeps SDPA)."""
        if (not self.allow_compiled or not KERNEL_PREFILL
                or not PrefillAttentionKernel.supports(q, k, layer.num_heads, layer.num_kv_heads)):
            return None
        if self._prefill_kernel is False:
            self._prefill_kernel = load_prefill_kernel()
        return self._prefill_kernel

    def make_cache(self, num_layers, num_blocks, num_kv_heads, head_dim, dtype, kv_cache_dtype="auto"):
        return PagedKVCache(num_layers, num_blocks, self.block_size, num_kv_heads, head_dim, dtype, self.device,
                            kv_cache_dtype)

    def bytes_per_block(self, num_layers, num_kv_heads, head_dim, dtype, kv_cache_dtype="auto") -> int:
        return PagedKVCache.bytes_per_block(num_layers, self.block_size, num_kv_heads, head_dim, dtype, kv_cache_dtype)

    def build_metadata(self, cache, prefills: list[PrefillItem], decodes: list[DecodeItem]) -> HeadMajorMetadata:
        """Each item carries one block table per KV group (`cache.num_groups` of them are read)."""
        n_groups, bs = cache.num_groups, self.block_size
        slots: list[list[int]] = [[] for _ in range(n_groups)]  # per KV group: each new token's pool slot
        for tables, start, end in [*prefills, *((t, pos, pos + 1) for t, pos in decodes)]:
            for g in range(n_groups):
                slots[g].extend(tables[g][p // bs] * bs + p % bs for p in range(start, end))
        chunks = [self._prefill_chunk(t[:n_groups], s, e, cache.quantized) for t, s, e in prefills]
        num_prefill = sum(e - s for _, s, e in prefills)
        mappings = [torch.tensor(s, dtype=torch.long, device=self.device) for s in slots]
        meta = HeadMajorMetadata(self, mappings[0], num_prefill, self.choose_ops(cache.dtype, num_prefill + len(decodes)),
                                 slot_mappings=mappings, prefills=chunks)
        if decodes:
            meta.decode_groups = self.decode_groups([t[:n_groups] for t, _ in decodes], [p + 1 for _, p in decodes],
                                                    cache.windows)
        return meta

    def _prefill_chunk(self, tables: list[list[int]], start: int, end: int, quantized: bool) -> PrefillChunk:
        """Tokens start..end-1 of one sequence. A whole context (start 0) attends to its own K/V (no gather
        unless int8); a later chunk gathers the cached context's blocks, its causal mask offset by `start`."""
        dev = self.device
        if start == 0 and not quantized:
            return PrefillChunk(end, end, [], None)
        blocks = [torch.tensor([t[:-(-end // self.block_size)]], dtype=torch.long, device=dev) for t in tables]
        if start == 0:
            return PrefillChunk(end, end, blocks, None)
        q_pos = torch.arange(start, end, device=dev).unsqueeze(1)
        k_pos = torch.arange(end, device=dev).unsqueeze(0)
        return PrefillChunk(end - start, end, blocks, k_pos <= q_pos)

    def decode_groups(self, tables: list[list[list[int]]], ctx_lens: list[int],
                      windows: list[int | None] | None = None) -> list[DecodeGroup]:
        """Groups of decodes (sorted by decreasing context) whose shortest context is at least half their
        longest, so a gather pads little; tiny groups join the previous one, as each costs a few launches."""
        bounds = [0]
        for i in range(1, len(ctx_lens)):
            if 2 * ctx_lens[i] < ctx_lens[bounds[-1]] and i - bounds[-1] >= MIN_DECODE_GROUP:
                bounds.append(i)
        if len(bounds) > 1 and len(ctx_lens) - bounds[-1] < MIN_DECODE_GROUP:
            bounds.pop()
        bounds.append(len(ctx_lens))
        windows = windows or [None] * len(tables[0])
        return [self._decode_group(tables[a:b], ctx_lens[a:b], windows)
                for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def _decode_group(self, tables: list[list[list[int]]], ctx_lens: list[int],
                      windows: list[int | None]) -> DecodeGroup:
        """`tables[i][g]`: sequence i's block table in KV group g. A sliding group's gather starts at the
        first block any of the group's queries still sees (`starts`), so its work is bounded by the window."""
        bs, dev = self.block_size, self.device
        max_blocks = -(-max(ctx_lens) // bs)
        starts = [0 if w is None else min(max(0, n - w) // bs for n in ctx_lens) for w in windows]
        per_group = [torch.tensor([t[g][lo:max_blocks] + [0] * (max_blocks - len(t[g][:max_blocks]))
                                   for t in tables], dtype=torch.long, device=dev)
                     for g, lo in enumerate(starts)]
        p = torch.arange(max_blocks * bs, device=dev)
        lens = torch.tensor(ctx_lens, dtype=torch.long, device=dev)
        return DecodeGroup(len(tables), per_group,
                           (p.unsqueeze(0) < lens.unsqueeze(1)).view(1, len(tables), 1, max_blocks * bs), starts, lens)

    def forward(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache,
                meta: HeadMajorMetadata) -> torch.Tensor:
        """`cache`: a PagedKVCache or GroupedKVCache; the layer's KV group picks its pool and slots."""
        g, pool, idx = cache.locate(layer.layer_idx)
        pool.write(idx, k, v, meta.slot_mappings[g])
        outs = []
        start = 0
        for i, chunk in enumerate(meta.prefills):
            end = start + chunk.q_len
            own = chunk.mask is None and not pool.quantized  # no cached context: this chunk's own K/V
            if own:
                kc, vc = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            else:
                kc, vc = (x[:, 0, :chunk.ctx_len] for x in pool.read_blocks(idx, chunk.blocks[g]))  # [Hkv, ctx, D]
            kernel = self.prefill_kernel(q, kc, layer)
            if kernel is not None:  # masks its own way: causal at the chunk's offset, and the layer's window
                out = kernel(q[start:end], kc.transpose(0, 1), vc.transpose(0, 1), layer.scale, layer.window or 0)
                if out is not None:
                    outs.append(out)
                    start = end
                    continue
            mask = chunk.mask if layer.window is None else meta.window_prefill_mask(i, layer.window)
            wide = prefill_dtype(q.dtype, q.device)  # float32 where the CPU has no fast matmul in q's dtype
            outs.append(_prefill_chunk(meta, layer, q[start:end].to(wide), kc.to(wide), vc.to(wide), mask,
                                      chunk).to(q.dtype))  # (.to of a tensor's own dtype returns it, no copy)
            start = end
        kernel = self.decode_kernel(q, pool, layer) if meta.decode_groups else None
        for i, group in enumerate(meta.decode_groups):
            qg = q[start:start + group.size]
            start += group.size
            if kernel is not None:
                outs.append(kernel(qg, pool.k[idx], pool.v[idx], group.blocks[g], group.lens, group.starts[g],
                                   self.block_size, layer.window or 0, layer.scale, pool.codes, *pool.scales(idx)))
                continue
            mask = group.mask if layer.window is None else meta.window_decode_mask(i, layer.window)
            if group.starts[g]:  # a sliding group gathers from the first block still in a window
                mask = mask[..., group.starts[g] * self.block_size:]
            outs.append(_decode(layer, qg, pool, idx, group.blocks[g], mask))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _prefill_chunk(meta: HeadMajorMetadata, layer: PagedAttention, q: torch.Tensor, kc: torch.Tensor,
                   vc: torch.Tensor, mask: torch.Tensor | None, chunk: PrefillChunk) -> torch.Tensor:
    """One prefill chunk's attention where no native kernel took it: the compiled function for small chunks,
    SDPA past compiled_attention_max_scores."""
    if meta.ops is Ops.COMPILED and chunk.q_len * chunk.ctx_len <= compiled_attention_max_scores(q.device):
        # contiguous: the compiled function is traced for one stride layout (a chunk's own K/V is a view of the
        # fused qkv output, a cached context a gathered copy), and a full layer's window is one no context
        # reaches, so full and sliding layers share one graph
        return kernels.call(Ops.COMPILED, causal_attention, q.contiguous(), kc.contiguous(), vc.contiguous(),
                            layer.scale, chunk.ctx_len - chunk.q_len, layer.window or NO_WINDOW)
    return _prefill_sdpa(layer, q, kc, vc, mask)


def _prefill_sdpa(layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
    """q [q_len, H, D]; k, v [Hkv, ctx, D]; mask [q_len, ctx] or None (plain causal) -> [q_len, H*D]."""
    qc, kc, vc = q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # [1, heads, len, D]
    o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, is_causal=mask is None, scale=layer.scale,
                                       enable_gqa=layer.num_heads != layer.num_kv_heads)
    return o.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)


def _decode(layer: PagedAttention, q: torch.Tensor, pool: PagedKVCache, idx: int, blocks: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor:
    """One query token per sequence over K/V gathered as [Hkv, B, C, D]: one SDPA call with KV heads as the
    batch, sequences as heads and their query heads as rows, so GQA needs no repeat and no transposed copy."""
    b = q.shape[0]
    hkv, g, d = layer.num_kv_heads, layer.num_heads // layer.num_kv_heads, layer.head_dim
    k, v = pool.read_blocks(idx, blocks)  # [Hkv, B, C, D]
    qg = q.view(b, hkv, g, d).transpose(0, 1)  # [Hkv, B, G, D]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=layer.scale)  # mask [1, B, 1, C]
    return out.transpose(0, 1).reshape(b, -1)  # [Hkv, B, G, D] -> [B, H*D]
