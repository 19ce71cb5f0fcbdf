"""GPTQ with its weighted range search, the range search's errors in C (`range_search.c`) against torch's, at the
linear shapes of real models: seconds per `gptq_quantize` call and of its range search, rounds interleaved in one
process, and how many groups' ranges the two pick differently.

    OMP_NUM_THREADS=2 python benchmarks/gptq_range_search.py --shapes 8192x2048,2048x8192 --group-sizes 128,32

Weights and the Hessian's inputs are random (Gaussian, a few heavy input columns): time does not depend on the
values, and the choices are compared on the same ones.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import llmopt.quant.gptq as gptq
from llmopt.quant import range_search_kernel
from llmopt.quant.scheme import QuantScheme

SHAPES = "2048x2048,8192x2048,2048x8192,14336x4096,4096x14336"  # 1.2B Llama: q/o, gate/up, down; Llama-3-8B: MLP


def _timed_call(w: torch.Tensor, H: torch.Tensor, scheme: QuantScheme, native: bool):
    """One gptq_quantize call with the range search's errors in C (`native`) or in torch (the kernel's loader
    answering None, as where it cannot be built); returns its weight, seconds, and seconds in the range search."""
    spent = [0.0]
    group_params, load = gptq.group_params, range_search_kernel.load

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return group_params(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    gptq.group_params = timed
    if not native:
        range_search_kernel.load = lambda: None
    try:
        t = time.perf_counter()
        qw, _ = gptq.gptq_quantize(w, H.clone(), scheme, mse_observer=True, own_h=True)
        return qw, time.perf_counter() - t, spent[0]
    finally:
        gptq.group_params, range_search_kernel.load = group_params, load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="OUTxIN weights, comma-separated")
    ap.add_argument("--group-sizes", default="128,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048, help="calibration rows behind the Hessian")
    args = ap.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    print("| shape | group | torch: call s (range search s) | C: call s (range search s) | call speed-up | groups "
          "picked differently |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        out, inp = (int(v) for v in shape.split("x"))
        g = torch.Generator().manual_seed(out + inp)
        w = torch.randn(out, inp, generator=g) * 0.02
        x = torch.randn(args.tokens, inp, generator=g)
        x[:, :8] *= 20  # heavy inputs, as real layers have
        H = x.t() @ x
        del x
        for gs in (int(v) for v in args.group_sizes.split(",")):
            scheme = QuantScheme(bits=4, group_size=gs)
            times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            scales: dict[bool, torch.Tensor] = {}
            for _ in range(args.rounds):
                for native in (False, True):
                    qw, call, search = _timed_call(w, H, scheme, native)
                    times[native].append((call, search))
                    scales[native] = qw.scale
            t0 = statistics.median(c for c, _ in times[False])
            s0 = statistics.median(s for _, s in times[False])
            t1 = statistics.median(c for c, _ in times[True])
            s1 = statistics.median(s for _, s in times[True])
            differ = int((scales[False] != scales[True]).sum())
            print(f"| {shape} | {gs} | {t0:.2f} ({s0:.2f}) | {t1:.2f} ({s1:.2f}) | {t0 / t1:.2f}x | "
                  f"{differ} of {scales[True].numel()} |", flush=True)


if __name__ == "__main__":
    main()
