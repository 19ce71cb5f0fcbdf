"""Our matmul over weights in VNNI pairs (`layers/bf16_linear.c`) against what ran before it, in ONE engine
process: bf16 linears against oneDNN's packed layout, W8A16's int8 linears against `Int8WeightOnlyLinear`
(`int8_linear.c` to 16 rows, dequantize + matmul past that). Per call over the model's linears at several
batch sizes, then single-stream decode and the mixed workload.

    OMP_NUM_THREADS=1 python benchmarks/bf16_linear_ab.py [--model smollm2-135m] [--rounds 3] [--rows 1,2,4,8,16,64,256]

The engine is built with its int8 linears as loaded, and both sides are held (same weights); rounds swap
the modules in place, alternating which side goes first. Calls: every linear once per timing (the tied head included), best
of the rounds. Engine: single stream (32-token prompt, 256 tokens, ignore_eos) and mixed (24 requests,
prompts 32-512, outputs 16-256, at most 8 at once), medians of the rounds. Absolute figures on shared
machines are noise; the ratios are the result.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from torch import nn

import llmopt.engine.builder as builder
from llmopt import LLM, SamplingParams
from llmopt.layers.linear import set_submodule
from llmopt.layers.packed_linear import PackedLinear, vnni_kernel
from llmopt.quant.packed_int8 import PackedInt8Linear

SIDES = ("before", "vnni")


def both_layouts(llm: LLM) -> dict[str, dict[str, nn.Module]]:
    """name -> module, per side: bf16 linears in oneDNN's layout and in VNNI pairs (the engine's own), the
    int8 linears as loaded and in VNNI pairs."""
    kernel = vnni_kernel()
    if kernel is None:
        raise SystemExit("no VNNI kernel here (no AVX512-BF16 or no C compiler)")
    sides: dict[str, dict[str, nn.Module]] = {s: {} for s in SIDES}
    for name, mod in llm.engine.model.named_modules():
        if isinstance(mod, PackedLinear) and mod.kernel is not None:
            lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, dtype=mod.dtype)
            with torch.no_grad():
                lin.weight.copy_(mod.weight)
                if mod.bias is not None:
                    lin.bias.copy_(mod.bias)
            sides["vnni"][name], sides["before"][name] = mod, PackedLinear(lin, vnni=False)
        elif PackedInt8Linear.takes(mod):
            sides["vnni"][name], sides["before"][name] = PackedInt8Linear(mod, kernel), mod
    return sides


def time_calls(mods: dict[str, nn.Module], rows: int) -> float:
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {m.in_features for m in mods.values()}}
    t0 = time.perf_counter()
    for m in mods.values():
        m(xs[m.in_features])
    return time.perf_counter() - t0


def generate(llm: LLM, seed: int, mixed: bool) -> float:
    rng = random.Random(seed)
    if mixed:
        reqs = [([rng.randrange(100, 40000) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
                for _ in range(24)]
    else:
        reqs = [([rng.randrange(100, 40000) for _ in range(32)], 256)]
    llm.engine.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate([p for p, _ in reqs], [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)
                                        for _, o in reqs], use_tqdm=False)
    return sum(o for _, o in reqs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default="1,2,4,8,16,64,256")
    args = ap.parse_args()
    builder.pack_int8_linears = lambda model: 0  # the int8 linears stay as loaded: both sides are made below
    llm = LLM(args.model, dtype="bfloat16", max_num_seqs=8)
    sides = both_layouts(llm)
    n8 = sum(isinstance(m, PackedInt8Linear) for m in sides["vnni"].values())
    mb = sum(m.packed.numel() * m.packed.element_size() for m in sides["vnni"].values()) / 1e6
    print(f"{len(sides['vnni']) - n8} bf16 and {n8} int8 linears, {mb:.0f} MB; torch threads {torch.get_num_threads()}")
    for rows in (int(r) for r in args.rows.split(",")):
        best = {s: min(time_calls(sides[s], rows) for _ in range(args.rounds)) for s in SIDES}
        print(f"calls, {rows:3d} rows: before {best['before'] * 1e3:7.1f} ms ({mb / best['before'] / 1e3:4.1f} GB/s), "
              f"VNNI {best['vnni'] * 1e3:7.1f} ms ({mb / best['vnni'] / 1e3:4.1f} GB/s) -> "
              f"{best['before'] / best['vnni']:.2f}x", flush=True)
    tps: dict[tuple[str, str], list[float]] = {(w, s): [] for w in ("single", "mixed") for s in SIDES}
    generate(llm, 0, mixed=True)  # compiles the prefill kernels both sides share
    for i in range(args.rounds):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            for name, mod in sides[side].items():
                set_submodule(llm.engine.model, name, mod)
            for w in ("single", "mixed"):
                tps[(w, side)].append(generate(llm, 100 + i, mixed=w == "mixed"))
            print(f"round {i + 1} {side}: single {tps[('single', side)][-1]:.1f}, "
                  f"mixed {tps[('mixed', side)][-1]:.1f} out tok/s", flush=True)
    for w in ("single", "mixed"):
        a, b = statistics.median(tps[(w, "before")]), statistics.median(tps[(w, "vnni")])
        print(f"{args.model} {w}: before {a:.1f}, VNNI {b:.1f} out tok/s -> {b / a:.2f}x")


if __name__ == "__main__":
    main()
