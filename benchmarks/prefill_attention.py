"""Prefill attention on AMX tiles (`prefill_attention.c`) against torch's flash SDPA, per call and in the engine.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/prefill_attention.py [--calls] [--engine smollm2-135m ...]
        [--prompts 2048x1,1024x1,512x4,256x4,256x1,64x1] [--rounds 10] [--chunk N]

Per call (`--calls`): causal attention over one chunk of L tokens (bf16, q/k/v as views of one fused projection,
as the engine hands them over), best of 5 x 5 calls each, for SmolLM2's, Gemma 3 270M's and two Llama-like head
layouts. In the engine (`--engine MODEL`): greedy prefill of random prompts (N x P tokens, 1 output token, no
prefix cache; `--chunk N`: prompts prefilled N tokens a step, each chunk after the first over the cached
context), the kernel and SDPA switched in one process, rounds alternating ABBA, medians. Needs a CPU with
AMX tiles (amx_bf16); elsewhere the kernel never runs and this says so.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import llmopt.native as native
from llmopt.layers.attention import head_major
from llmopt.layers.attention.prefill_attention_kernel import load

LAYOUTS = [(9, 3, 64, "SmolLM2-135M"), (4, 1, 256, "Gemma 3 270M (no window)"), (32, 8, 64, "1.2B-like"),
           (32, 8, 128, "Llama-3-8B")]


def best_ms(fn, reps: int = 5) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def calls() -> None:
    kernel = load()
    assert kernel is not None
    print("| heads (q / kv) x dim | tokens | SDPA ms | AMX kernel ms | kernel / SDPA |\n|---|---|---|---|---|")
    for h, hkv, d, name in LAYOUTS:
        for n in (64, 256, 1024, 2048):
            qkv = torch.randn(n, (h + 2 * hkv) * d, dtype=torch.bfloat16)
            q, k, v = (qkv[:, :h * d].view(n, h, d), qkv[:, h * d:(h + hkv) * d].view(n, hkv, d),
                       qkv[:, (h + hkv) * d:].view(n, hkv, d))

            def sdpa(q=q, k=k, v=v, n=n, h=h, hkv=hkv, d=d):
                o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                   v.transpose(0, 1)[None], is_causal=True, scale=d ** -0.5,
                                                   enable_gqa=h != hkv)
                return o[0].transpose(0, 1).reshape(n, -1)

            a = best_ms(sdpa)
            b = best_ms(lambda q=q, k=k, v=v, d=d: kernel(q, k, v, d ** -0.5))
            print(f"| {name}: {h} / {hkv} x {d} | {n} | {a:.3f} | {b:.3f} | {a / b:.2f}x |", flush=True)


def engine(model: str, prompts: list[tuple[int, int]], rounds: int, chunk: int | None) -> None:
    from llmopt import LLM
    from llmopt.engine.sampling_params import SamplingParams

    llm = LLM(model, dtype="bfloat16", device="cpu", enable_prefix_caching=False,
              **({"max_num_batched_tokens": chunk} if chunk else {}))
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    g = torch.Generator()

    def run(p: int, n: int, seed: int) -> float:
        g.manual_seed(seed)
        batch = [{"prompt_token_ids": torch.randint(100, 30000, (p,), generator=g).tolist()} for _ in range(n)]
        t = time.perf_counter()
        llm.generate(batch, sp, use_tqdm=False)
        return p * n / (time.perf_counter() - t)

    print(f"\n{model}: prefill tok/s{f', {chunk} tokens a step' if chunk else ''}, medians of {rounds} rounds a side\n")
    print("| prompts | SDPA | AMX kernel | kernel / SDPA |\n|---|---|---|---|")
    order = ("ABBA" * rounds)[: 2 * rounds]
    try:
        for p, n in prompts:
            got: dict[str, list[float]] = {"A": [], "B": []}
            for side in "AB":  # warm-up
                head_major.AMX_PREFILL = side == "B"
                run(p, n, 0)
            for r, side in enumerate(order):
                head_major.AMX_PREFILL = side == "B"
                got[side].append(run(p, n, r + 1))
            a, b = statistics.median(got["A"]), statistics.median(got["B"])
            print(f"| {n} x {p} | {a:.0f} | {b:.0f} | {b / a:.3f}x |", flush=True)
    finally:
        head_major.AMX_PREFILL = native.cpu_has("amx_bf16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", action="store_true", help="per-call comparison")
    ap.add_argument("--engine", nargs="*", default=[], metavar="MODEL", help="engine prefill A/B on these models")
    ap.add_argument("--prompts", default="2048x1,1024x1,512x4,256x4,256x1,64x1", help="PxN,... prompt tokens x prompts")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--chunk", type=int, help="prefill at most this many tokens a step (max_num_batched_tokens)")
    args = ap.parse_args()
    if not native.cpu_has("amx_bf16"):
        raise SystemExit("this CPU has no AMX tiles (amx_bf16): the kernel never runs here")
    print(f"{native.cpu_vendor()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    if args.calls:
        calls()
    prompts = [tuple(int(x) for x in item.split("x")) for item in args.prompts.split(",")]
    for model in args.engine:
        engine(model, prompts, args.rounds, args.chunk)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
