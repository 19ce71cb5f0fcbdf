"""Sliding-window KV memory, measured in the engine: the KV blocks one sequence holds at an 8k-token
context, with the sliding layers in their own pool (what the engine does) against what a single pool
keeping every layer for the whole context would hold.

    python benchmarks/sliding_window_memory.py [--model gemma3-270m] [--context 8192] [--dtype bfloat16]

The request is a WikiText-2 prompt of `context - new_tokens` tokens decoded greedily for `new_tokens`
tokens; after every step the script records how many blocks each KV group of the sequence holds.
Bytes come from the pools' own per-block sizes (`PagedKVCache.bytes_per_block`), so the single-pool
figure is exact: it is every layer's bytes per block times the blocks of the whole context.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmopt import LLM, SamplingParams
from llmopt.layers.attention import PagedKVCache

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext2-valid.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json")
    a = ap.parse_args()
    llm = LLM(a.model, dtype=a.dtype, max_num_seqs=1, max_model_len=a.context + 16, enable_prefix_caching=False)
    eng = llm.engine
    ids = eng.tokenizer.encode(DATA.read_text())[:a.context - a.new_tokens]
    rid = eng.add_request(prompt_token_ids=ids, params=SamplingParams(temperature=0, max_tokens=a.new_tokens,
                                                                       ignore_eos=True))
    seq = eng.get_request(rid).seqs[0]
    peak = [0] * eng.kv_cache.num_groups
    while eng.has_unfinished_requests():
        eng.step()
        if not seq.is_finished:
            for g, t in enumerate(seq.kv_tables):
                peak[g] = max(peak[g], len(t.blocks) - t.num_released)
            context = seq.num_tokens
    s, bs = eng.spec, eng.config.block_size
    pools = getattr(eng.kv_cache, "pools", [eng.kv_cache])
    per_block = [PagedKVCache.bytes_per_block(p.num_layers, bs, s.num_kv_heads, s.head_dim, p.dtype,
                                              "int8" if p.quantized else "auto") for p in pools]
    held = sum(n * b for n, b in zip(peak, per_block, strict=True))
    single = PagedKVCache.bytes_per_block(s.num_layers, bs, s.num_kv_heads, s.head_dim, pools[0].dtype,
                                          "int8" if pools[0].quantized else "auto") * -(-context // bs)
    groups = [{"window": w, "layers": len(layers), "peak_blocks": n, "bytes_per_block": b}
              for (w, layers), n, b in zip(s.kv_groups, peak, per_block, strict=True)]
    out = {"model": a.model, "dtype": a.dtype, "context": context, "block_size": bs, "groups": groups,
           "held_bytes": held, "single_pool_bytes": single, "ratio": held / single}
    for g in groups:
        kind = "full" if g["window"] is None else f"sliding {g['window']}"
        print(f"{kind:>12}: {g['layers']:2d} layers, peak {g['peak_blocks']:4d} blocks x {g['bytes_per_block']:,} B")
    print(f"context {context} tokens: held {held / 2**20:.1f} MiB, single pool {single / 2**20:.1f} MiB, "
          f"ratio {held / single:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
