"""bf16 decode attention per layer call: the paged decode kernel against gather + SDPA (the path it
replaced), side by side in one process, over the same pool and random block tables.

    OMP_NUM_THREADS=1 python benchmarks/decode_attention.py [--kv-heads 3 --group 3 --head-dim 64]

Each row: B sequences with contexts between C-12 and C tokens, blocks of 16 drawn at random from a
pool of 4096 (so the context is not cache-resident), best of 5 repeats of 20 calls per side,
alternating. Absolute times on shared machines are noise; the ratio is the result.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from llmopt.layers.attention import PagedAttention, PagedKVCache
from llmopt.layers.attention.head_major import _decode
from llmopt.layers.attention.paged_decode_kernel import load

SIZES = [(1, 64), (1, 512), (4, 300), (8, 200), (16, 400), (32, 400), (64, 300)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()
    kernel = load()
    if kernel is None:
        raise SystemExit("the paged decode kernel cannot be built here (see the warning above)")
    hkv, g, d, bs, nb = args.kv_heads, args.group, args.head_dim, 16, 4096
    h = hkv * g
    layer = PagedAttention(0, h, hkv, d)
    scale = layer.scale
    gen = torch.Generator().manual_seed(0)
    pool = PagedKVCache(1, nb, bs, hkv, d, torch.bfloat16, torch.device("cpu"))
    pool.k[0].copy_(torch.randn(hkv, nb * bs, d, generator=gen))
    pool.v[0].copy_(torch.randn(hkv, nb * bs, d, generator=gen))
    kp, vp = pool.k[0], pool.v[0]
    rng = random.Random(0)

    def gather_sdpa(q, blocks, mask):  # the head-major backend's decode path without the kernel
        return _decode(layer, q, pool, 0, blocks, mask)

    def best_ms(fn) -> float:
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            runs.append((time.perf_counter() - t0) / 20 * 1000)
        return min(runs)

    for b, c in SIZES:
        n = -(-c // bs)
        blocks = torch.tensor([rng.sample(range(nb), n) for _ in range(b)])
        lens = torch.tensor([c - rng.randrange(0, 12) for _ in range(b)])
        q = torch.randn(b, h, d, generator=gen).to(torch.bfloat16)
        mask = (torch.arange(n * bs).view(1, -1) < lens.view(-1, 1)).view(1, b, 1, n * bs)
        ref = gather_sdpa(q, blocks, mask)
        got = kernel(q, kp, vp, blocks, lens, 0, bs, 0, scale)
        err = (ref.float() - got.float()).abs().max().item()
        t_ref = best_ms(lambda q=q, blocks=blocks, mask=mask: gather_sdpa(q, blocks, mask))
        t_new = best_ms(lambda q=q, blocks=blocks, lens=lens: kernel(q, kp, vp, blocks, lens, 0, bs, 0, scale))
        print(json.dumps({"sequences": b, "context": c, "gather_sdpa_ms": round(t_ref, 3), "kernel_ms": round(t_new, 3),
                          "speedup": round(t_ref / t_new, 2), "max_abs_diff": err,
                          "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
