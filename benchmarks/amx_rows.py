"""Row count by row count: which kernel runs a bf16 (or W8A16, W4A16) linear fastest on this CPU, and whether
the default engine keeps up with `enforce_eager=True` (oneDNN's F.linear, which takes AMX tiles where the CPU
has them) at every batch size. Issues #29, #31.

    OMP_NUM_THREADS=1 python benchmarks/amx_rows.py [--model smollm2-135m] [--rounds 3] [--skip-engine]
        [--w8a16 CKPT] [--w4a16 CKPT] [--skip-bf16]

1. Per call, over every linear of the model once (the tied head included), in one process: our VNNI kernel,
   our AMX kernel (where the CPU has AMX) and F.linear on the plain weight, at each row count; int8 weights
   too (`--w8a16`: the VNNI/AMX kernels over int8 panels against `Int8WeightOnlyLinear`, enforce_eager's
   path), and int4 ones (`--w4a16`: the int4 kernel's own passes against AMX tiles over dequantized panels;
   enforce_eager runs the same kernel). Rounds rotate the order of the sides; the best of the rounds is printed.
2. The engine: default against enforce_eager, both loaded in this process, on (a) one prompt of P tokens
   (prefill, P rows per step) and (b) B sequences decoding together (B rows per step), ABBA rounds; tokens/s
   medians and their ratio. For `--w4a16` (where the CPU has AMX) the other side is the default engine with
   int4 AMX tiles turned off instead.

Absolute figures on shared machines are noise; the ratios are the result. The CPU and thread count are
printed first (docs/BENCHMARKS.md names them with every figure).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from llmopt import LLM, SamplingParams
from llmopt.layers.packed_linear import PackedLinear, vnni_kernel
from llmopt.quant.linear import Int4WeightOnlyLinear
from llmopt.quant.packed_int8 import PackedInt8Linear


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            flags = Path("/proc/cpuinfo").read_text()
            feats = [f for f in ("amx_bf16", "amx_int8", "avx512_bf16") if f" {f}" in flags]
            return f"{line.split(':', 1)[1].strip()} ({', '.join(feats) or 'no AMX / AVX512-BF16'})"
    return platform.processor()


WEIGHTS = {  # weight kind -> (the module class on our kernels, amx_min_rows' key)
    "bf16": (PackedLinear, torch.bfloat16),
    "int8": (PackedInt8Linear, torch.int8),
    "int4": (Int4WeightOnlyLinear, torch.uint8),
}


def on_kernel(m: torch.nn.Module) -> bool:
    return getattr(m, "kernel", None) is not None or getattr(m, "mode", None) == "cpu-vnni-int4"


def per_call(llm: LLM, eager_llm: LLM, rows_list: list[int], rounds: int, weights: str) -> None:
    kernel = vnni_kernel()
    if kernel is None:
        raise SystemExit("no VNNI kernel here (no AVX512-BF16 or no C compiler)")
    kind, wdtype = WEIGHTS[weights]
    names = [n for n, m in llm.engine.model.named_modules() if isinstance(m, kind) and on_kernel(m)]
    if not names:
        raise SystemExit("no linears of that kind on our kernels in this engine")
    mods = [llm.engine.model.get_submodule(n) for n in names]
    sides = {"vnni": (10**9, mods)}
    if weights != "int4":  # enforce_eager runs int4 on the same kernel
        sides["onednn/eager"] = (None, [eager_llm.engine.model.get_submodule(n) for n in names])
    if kernel.amx:
        sides["amx"] = (1, mods)
    print(f"\nper call, {weights} weights, {len(mods)} linears (us per pass, best of {rounds}):")
    print(f"{'rows':>6} " + " ".join(f"{s:>13}" for s in sides) + "   fastest")
    saved = dict(kernel.amx_min_rows)
    try:
        for rows in rows_list:
            xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {m.in_features for m in mods}}
            best = {s: float("inf") for s in sides}
            names = list(sides)
            for r in range(rounds):
                for s in names[r % len(names):] + names[: r % len(names)]:
                    threshold, fns = sides[s]
                    if threshold is not None:
                        kernel.amx_min_rows[wdtype] = threshold
                    reps = max(1, 64 // rows)
                    for fn, m in zip(fns, mods, strict=True):
                        fn(xs[m.in_features])  # warm
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        for fn, m in zip(fns, mods, strict=True):
                            fn(xs[m.in_features])
                    best[s] = min(best[s], (time.perf_counter() - t0) / reps)
            print(f"{rows:>6} " + " ".join(f"{best[s] * 1e6:>13.0f}" for s in sides)
                  + f"   {min(best, key=best.get)}")
    finally:
        kernel.amx_min_rows = saved


def engine_rate(llm: LLM, shape: tuple[str, int], seed: int) -> float:
    kind, n = shape
    rng = random.Random(seed)
    if kind == "prefill":  # one prompt of n tokens and one output token: the step is n rows
        prompts, out = [[rng.randrange(100, 40000) for _ in range(n)]], 1
    else:  # n sequences of 8-token prompts decoding 32 tokens together: n rows per decode step
        prompts, out = [[rng.randrange(100, 40000) for _ in range(8)] for _ in range(n)], 32
    llm.engine.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True), use_tqdm=False)
    dt = time.perf_counter() - t0
    return (n if kind == "prefill" else n * out) / dt


def engine(model: str, dtype: str, rounds: int, shapes: list[tuple[str, int]], int4_amx_off: bool = False) -> None:
    """default against enforce_eager, or (`int4_amx_off`) against the default with int4 AMX tiles turned off:
    amx_min_rows is set before each side is built (the decode step's program reads it then) and before each of
    its rounds (the modules read it per call)."""
    kernel = vnni_kernel()
    saved = dict(kernel.amx_min_rows) if kernel is not None else {}
    other = "int4 vnni" if int4_amx_off else "eager"
    thresholds = {"default": saved.get(torch.uint8), other: 10**9 if int4_amx_off else saved.get(torch.uint8)}

    def set_side(s: str) -> None:
        if kernel is not None:
            kernel.amx_min_rows[torch.uint8] = thresholds[s]

    try:
        sides = {}
        for s in ("default", other):
            set_side(s)
            sides[s] = LLM(model, dtype=dtype, max_num_seqs=64, max_num_batched_tokens=2048,
                           enforce_eager=s == "eager")
            engine_rate(sides[s], ("prefill", 128), 0)  # compile / build once before timing
            engine_rate(sides[s], ("decode", 4), 0)
        print(f"\nengine ({model}, {dtype}), tokens/s, medians of {rounds} ABBA rounds:")
        print(f"{'shape':>14} {'default':>10} {other:>10} {'default/' + other:>14}")
        for shape in shapes:
            rates: dict[str, list[float]] = {s: [] for s in sides}
            order = list(sides)
            for r in range(rounds):
                for s in (order if r % 2 == 0 else order[::-1]):
                    set_side(s)
                    rates[s].append(engine_rate(sides[s], shape, 1000 * r + shape[1]))
            a, b = statistics.median(rates["default"]), statistics.median(rates[other])
            ratios = [x / y for x, y in zip(rates["default"], rates[other], strict=True)]
            print(f"{shape[0] + ' ' + str(shape[1]):>14} {a:>10.1f} {b:>10.1f} {a / b:>13.2f}x"
                  f"  (rounds {', '.join(f'{x:.2f}' for x in ratios)})")
    finally:
        if kernel is not None:
            kernel.amx_min_rows = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default="1,2,3,4,6,8,12,16,24,32,64,128,256,1024")
    ap.add_argument("--w8a16", default=None, help="a W8A16 checkpoint: also time its int8 linears per call")
    ap.add_argument("--w4a16", default=None, help="a W4A16 checkpoint: also time its int4 linears per call, and "
                    "its engine with int4 AMX tiles on and off")
    ap.add_argument("--prefill", default="16,64,256,1024")
    ap.add_argument("--decode", default="1,2,4,8,16,32,64")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-bf16", action="store_true", help="only the --w8a16 / --w4a16 checkpoints' runs")
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}; torch threads: {torch.get_num_threads()}; torch {torch.__version__}")
    rows = [int(r) for r in args.rows.split(",")]
    for model, weights in [(None if args.skip_bf16 else args.model, "bf16"), (args.w8a16, "int8"),
                           (args.w4a16, "int4")]:
        if model is not None:
            per_call(LLM(model, dtype="bfloat16"), LLM(model, dtype="bfloat16", enforce_eager=True), rows, args.rounds,
                     weights)
    if not args.skip_engine:
        shapes = [("prefill", int(n)) for n in args.prefill.split(",") if n] + \
                 [("decode", int(n)) for n in args.decode.split(",") if n]
        if not args.skip_bf16:
            engine(args.model, "bfloat16", args.rounds, shapes)
        if args.w8a16:
            engine(args.w8a16, "bfloat16", args.rounds, shapes)
        if args.w4a16 and vnni_kernel() is not None and vnni_kernel().amx:
            engine(args.w4a16, "bfloat16", args.rounds, shapes, int4_amx_off=True)


if __name__ == "__main__":
    main()
