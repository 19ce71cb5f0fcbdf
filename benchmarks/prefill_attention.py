"""Our prefill attention kernel (`prefill_attention.c`: AMX tiles, or float32 FMAs off AMX) against what the
head-major backend runs without it (torch's flash SDPA, or its torch.compile'd function), per call and in the engine.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/prefill_attention.py [--calls] [--engine smollm2-135m ...]
        [--prompts 2048x1,1024x1,512x4,256x4,256x1,64x1] [--rounds 10] [--chunk N]

Per call (`--calls`): causal attention over one chunk of L tokens (bf16, q/k/v as views of one fused projection,
as the engine hands them over), best of 5 x 5 calls each, for SmolLM2's, Gemma 3 270M's and two Llama-like head
layouts: SDPA, the compiled function where the backend would run it at that size, and the kernel. In the engine
(`--engine MODEL`): greedy prefill of random prompts (N x P tokens, 1 output token, no prefix cache; `--chunk N`:
prompts prefilled N tokens a step, each chunk after the first over the cached context), the kernel and the
backend's path without it switched in one process, rounds alternating ABBA, medians. `--calls` runs wherever the
kernel builds (AMX tiles or AVX512-BF16), so it can tell whether a CPU the backend does not send chunks to the
kernel yet (AMD's Zen 4) should; `--engine` needs one it does (`prefill_attention_kernel.runs_here`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import llmopt.native as native
from llmopt.layers.attention import head_major
from llmopt.layers.attention.prefill_attention_kernel import load, runs_here

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
    from llmopt.layers.kernels import Ops, call

    kernel = load()
    probe = torch.zeros(1, 1, 32, dtype=torch.bfloat16)
    if kernel is None or kernel(probe, probe, probe, 1.0) is None:
        raise SystemExit("the prefill attention kernel does not run here (no C compiler, or neither AMX tiles nor "
                         "AVX512-BF16)")
    kind = "AMX" if kernel.amx else "float32"
    print(f"| heads (q / kv) x dim | tokens | SDPA ms | compiled ms | {kind} kernel ms | the faster of the two / kernel |"
          "\n|---|---|---|---|---|---|")
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

            def compiled(q=q, k=k, v=v, d=d):
                return call(Ops.COMPILED, head_major.causal_attention, q.contiguous(),
                            k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), d ** -0.5, 0,
                            head_major.NO_WINDOW)

            a = best_ms(sdpa)
            c = best_ms(compiled) if n * n <= head_major.compiled_attention_max_scores(torch.device("cpu")) else None
            b = best_ms(lambda q=q, k=k, v=v, d=d: kernel(q, k, v, d ** -0.5))
            other = min(a, c) if c is not None else a
            print(f"| {name}: {h} / {hkv} x {d} | {n} | {a:.3f} | {'' if c is None else f'{c:.3f}'} | {b:.3f} | "
                  f"{other / b:.2f}x |", flush=True)


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
    print("| prompts | without the kernel | with it | with / without |\n|---|---|---|---|")
    order = ("ABBA" * rounds)[: 2 * rounds]
    try:
        for p, n in prompts:
            got: dict[str, list[float]] = {"A": [], "B": []}
            for side in "AB":  # warm-up
                head_major.KERNEL_PREFILL = side == "B"
                run(p, n, 0)
            for r, side in enumerate(order):
                head_major.KERNEL_PREFILL = side == "B"
                got[side].append(run(p, n, r + 1))
            a, b = statistics.median(got["A"]), statistics.median(got["B"])
            print(f"| {n} x {p} | {a:.0f} | {b:.0f} | {b / a:.3f}x |", flush=True)
    finally:
        head_major.KERNEL_PREFILL = runs_here()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", action="store_true", help="per-call comparison")
    ap.add_argument("--engine", nargs="*", default=[], metavar="MODEL", help="engine prefill A/B on these models")
    ap.add_argument("--prompts", default="2048x1,1024x1,512x4,256x4,256x1,64x1", help="PxN,... prompt tokens x prompts")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--chunk", type=int, help="prefill at most this many tokens a step (max_num_batched_tokens)")
    args = ap.parse_args()
    print(f"{native.cpu_vendor()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    if args.calls:
        calls()
    if args.engine and not runs_here():
        raise SystemExit("the backend sends no prefill chunk to the kernel on this CPU (prefill_attention_kernel."
                         "runs_here): --calls measures whether it should")
    prompts = [tuple(int(x) for x in item.split("x")) for item in args.prompts.split(",")]
    for model in args.engine:
        engine(model, prompts, args.rounds, args.chunk)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
