"""W4A16 per decoder layer: our VNNI-panel int4 kernel against torch's tinygemm CPU kernel, against our
own kernel's source at a git revision, or against itself with AMX tiles turned off, side by side.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/int4_kernel.py [--shape 1b|8b|smollm2] [--group 128]
        [--rows 1,4,16,64] [--rounds 20] [--rev REV | --amx-off | --fma-off] [--layers 1]

The four linears of one decoder layer of the shape (q|k|v, o, gate|up, down), symmetric int4 from random
weights, built as `Int4WeightOnlyLinear`: on our kernel (the default where the CPU has AVX512-BF16) and, as
the other side, on tinygemm (`_weight_int4pack_mm_for_cpu`), or with `--rev` on `bf16_linear.c` as it was
at REV, built next to the tree's and loaded in the same process (the same packed weights), or with
`--amx-off` on the tree's kernel with its int4 AMX path turned off (where the CPU has AMX), or with `--fma-off`
on the tree's kernel with its passes in vdpbf16ps rather than float32 FMAs (`Bf16LinearKernel.fma`). Rounds
alternate the two, and the median of each is kept; GB/s is the packed weights and scales read per call over
that time. `--layers N` builds N such layers and runs them in turn, so each call finds its weights out of
cache, as in a decode step (one layer, the default, stays in cache between rounds).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch
from kernel_ab import source_at  # benchmarks/: the kernel source at a git revision

import llmopt.native as native
from llmopt.layers import packed_linear
from llmopt.quant.linear import Int4WeightOnlyLinear
from llmopt.quant.rtn import rtn_quantize
from llmopt.quant.scheme import QuantScheme

SHAPES = {  # (out, in) of q|k|v, o, gate|up, down
    "1b": [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)],
    "8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
}


def build(out_f: int, in_f: int, group: int, tinygemm: bool) -> Int4WeightOnlyLinear:
    qw = rtn_quantize(torch.randn(out_f, in_f) * 0.02, QuantScheme(bits=4, group_size=group))
    if not tinygemm:
        return Int4WeightOnlyLinear.from_quantized(qw, None, torch.bfloat16, "cpu")
    build_vnni = Int4WeightOnlyLinear._build_vnni
    Int4WeightOnlyLinear._build_vnni = lambda self, qw, perm: False  # type: ignore[method-assign]
    try:
        return Int4WeightOnlyLinear.from_quantized(qw, None, torch.bfloat16, "cpu")
    finally:
        Int4WeightOnlyLinear._build_vnni = build_vnni  # type: ignore[method-assign]


def kernel_at(rev: str, tmp: Path) -> packed_linear.Bf16LinearKernel:
    """bf16_linear.c as it was at `rev`, built and loaded apart from the tree's."""
    source = source_at(rev, packed_linear.SOURCE, tmp / packed_linear.SOURCE.name)
    cc = native.compiler()
    if cc is None:
        raise SystemExit("no C compiler: the kernel cannot be built here")
    return packed_linear.Bf16LinearKernel(native.build(source, cc, tmp))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--rev", help="the other side is our kernel at this git revision, not tinygemm")
    ap.add_argument("--amx-off", action="store_true", help="the other side is our kernel without int4 AMX tiles")
    ap.add_argument("--fma-off", action="store_true",
                    help="the other side is our kernel with its passes in vdpbf16ps, not float32 FMAs")
    ap.add_argument("--layers", type=int, default=1, help="layers run in turn (a model's worth: weights cold)")
    args = ap.parse_args()
    torch.manual_seed(0)
    other = (f"ours at {args.rev}" if args.rev else "ours, no AMX" if args.amx_off
             else "ours, vdpbf16ps" if args.fma_off else "tinygemm")
    with tempfile.TemporaryDirectory(prefix="int4-kernel-") as tmp:
        shapes = SHAPES[args.shape]
        ours = [build(o, i, args.group, False) for _ in range(args.layers) for o, i in shapes]
        assert all(m.mode == "cpu-vnni-int4" for m in ours), "our kernel does not run on this CPU"
        kernel = ours[0]._vnni
        amx_rows = {"ours": kernel.amx_min_rows[torch.uint8], other: kernel.amx_min_rows[torch.uint8]}
        fma = {"ours": kernel.fma, other: kernel.fma and not args.fma_off}
        if args.rev:  # the same weights on the other library
            old = kernel_at(args.rev, Path(tmp))
            theirs = [copy.copy(m) for m in ours]  # shares the packed buffers
            for m in theirs:
                m._vnni = old
        elif args.amx_off:
            if not kernel.amx:
                raise SystemExit("this CPU (or its kernel) lends no AMX tiles")
            theirs, amx_rows[other] = ours, 10**9
        elif args.fma_off:
            if not kernel.fma:
                raise SystemExit("the float32 passes are off on this CPU already (Bf16LinearKernel.fma)")
            theirs = ours
        else:
            theirs = [build(o, i, args.group, True) for _ in range(args.layers) for o, i in shapes]
        layers = {"ours": ours, other: theirs}
        nbytes = sum(m.weight_nbytes() for m in ours)
        print(f"{args.shape}, {args.layers} layer(s), int4 g{args.group}: {nbytes / 1e6:.1f} MB of packed weights "
              f"and scales, {torch.get_num_threads()} threads")
        print(f"| rows | {other} ms | ours ms | ours / {other} speed | ours GB/s |\n|---|---|---|---|---|")
        for rows in map(int, args.rows.split(",")):
            xs = [torch.randn(rows, i).to(torch.bfloat16) for _, i in shapes] * args.layers
            times: dict[str, list[float]] = {name: [] for name in layers}
            for r in range(args.rounds + 2):
                for name in (("ours", other) if r % 2 else (other, "ours")):
                    kernel.amx_min_rows[torch.uint8] = amx_rows[name]
                    kernel.fma = fma[name]
                    t0 = time.perf_counter()
                    for m, x in zip(layers[name], xs, strict=True):
                        m(x)
                    if r >= 2:  # two warm-up rounds
                        times[name].append(time.perf_counter() - t0)
            mine, theirs_t = statistics.median(times["ours"]), statistics.median(times[other])
            print(f"| {rows} | {theirs_t * 1e3:.2f} | {mine * 1e3:.2f} | {theirs_t / mine:.2f}x | "
                  f"{nbytes / mine / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
