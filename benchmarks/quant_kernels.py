"""Microbenchmark: dense fp32 / bf16 matmul vs our int8 and int4 weight-only CPU kernels.

Run: .venv/bin/python benchmarks/quant_kernels.py [--threads N] [--iters N]
Prints min and median microseconds per call and each variant's speed-up over fp32 F.linear, for
SmolLM2-135M-like shapes (decode M=1, prefill-ish M=32, and the 49152-wide lm_head).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmopt.quant import (
    Fp8WeightOnlyLinear,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    QuantScheme,
    fp8_quantize,
    rtn_quantize,
)

SHAPES = [(1, 576, 1536), (32, 576, 1536), (1, 576, 49152)]


def bench(fn: Callable[[], torch.Tensor], iters: int) -> tuple[float, float]:
    """(min, median) wall time of one call in microseconds, after warm-up. The minimum is the
    number to compare on a shared machine; the median shows how noisy it was."""
    for _ in range(max(3, iters // 10)):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e6, statistics.median(times) * 1e6


def variants_for(m: int, k: int, n: int, group_size: int) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """The contenders for one shape, each a zero-argument call."""
    w = torch.randn(n, k) * 0.02
    x = torch.randn(m, k)
    w_bf16, x_bf16 = w.bfloat16(), x.bfloat16()
    int8 = Int8WeightOnlyLinear.from_quantized(rtn_quantize(w, QuantScheme(bits=8, group_size=-1)))
    q4 = rtn_quantize(w, QuantScheme(bits=4, group_size=group_size))
    int4 = Int4WeightOnlyLinear.from_quantized(q4)
    int4_fp32 = Int4WeightOnlyLinear.from_quantized(q4, compute_dtype=torch.float32)
    fp8 = Fp8WeightOnlyLinear.from_quantized(fp8_quantize(w))
    return [
        ("fp32 F.linear", lambda: F.linear(x, w)),
        ("bf16 F.linear", lambda: F.linear(x_bf16, w_bf16)),
        (f"int8 kernel ({int8.mode})", lambda: int8(x_bf16)),
        (f"int4 kernel ({int4.mode})", lambda: int4(x_bf16)),
        ("int4 kernel, fp32 act", lambda: int4_fp32(x)),
        ("fp8 emulated (bf16)", lambda: fp8(x_bf16)),
    ]


def run_shape(m: int, k: int, n: int, group_size: int, iters: int) -> None:
    base = None
    for name, fn in variants_for(m, k, n, group_size):
        us, med = bench(fn, iters)
        base = base or us
        print(f"{f'{m}x{k}->{n}':>14} {name:>30} {us:9.1f} {med:10.1f} {base / us:7.2f}x")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--group-size", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, int4 group={args.group_size}")
    header = f"{'M x K -> N':>14} {'variant':>30} {'min us':>9} {'median us':>10} {'vs fp32':>8}"
    print(header)
    print("-" * len(header))
    with torch.inference_mode():
        for m, k, n in SHAPES:
            run_shape(m, k, n, args.group_size, args.iters)


if __name__ == "__main__":
    main()
