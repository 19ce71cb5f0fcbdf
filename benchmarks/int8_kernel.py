"""W8A16 per decoder layer on our VNNI-panel kernel (`bf16_linear.c`, int8 panels with per-output scales): the
tree's kernel against its source at a git revision, against itself with its passes in vdpbf16ps rather than
float32 FMAs, or against itself with AMX tiles off, side by side.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/int8_kernel.py [--shape 1b|8b|smollm2|head]
        [--rows 1,4,16] [--rounds 10] (--rev REV | --fma-off | --amx-off) [--layers 1]

The four linears of one decoder layer of the shape (`head`: SmolLM2's 49152 x 576 lm_head alone), random int8
codes and bf16 scales packed once and shared by both sides; `--rev` loads `bf16_linear.c` as it was at REV
next to the tree's. Rounds alternate the two sides (ABBA), medians kept; GB/s is the int8 weights read per call
over that time. `--layers N` runs N such layers in turn (a model's worth: weights cold, as in decode).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from int4_kernel import SHAPES, kernel_at  # benchmarks/

from llmopt.layers.packed_linear import pack_vnni, vnni_kernel

SHAPES = {**SHAPES, "head": [(49152, 576)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=10)
    side = ap.add_mutually_exclusive_group(required=True)
    side.add_argument("--rev", help="the other side is the kernel at this git revision")
    side.add_argument("--fma-off", action="store_true", help="the other side runs its passes in vdpbf16ps")
    side.add_argument("--amx-off", action="store_true", help="the other side never runs on AMX tiles")
    ap.add_argument("--layers", type=int, default=1)
    args = ap.parse_args()
    kernel = vnni_kernel()
    if kernel is None:
        raise SystemExit("our kernel does not run on this CPU (no AVX512-BF16 or no C compiler)")
    if args.fma_off and not kernel.fma:
        raise SystemExit("the float32 passes are off on this CPU already (Bf16LinearKernel.fma)")
    if args.amx_off and not kernel.amx:
        raise SystemExit("this CPU (or its kernel) lends no AMX tiles")
    g = torch.Generator().manual_seed(0)
    layers = [[(pack_vnni(torch.randint(-127, 128, (o, i), generator=g, dtype=torch.int8)),
                (torch.rand(o, generator=g) * 0.01).to(torch.bfloat16), o, i) for o, i in SHAPES[args.shape]]
              for _ in range(args.layers)]
    nbytes = sum(o * i for o, i in SHAPES[args.shape]) * args.layers
    with tempfile.TemporaryDirectory(prefix="int8-kernel-") as tmp:
        other_kernel = kernel_at(args.rev, Path(tmp)) if args.rev else kernel
        other = f"at {args.rev}" if args.rev else "vdpbf16ps" if args.fma_off else "no AMX"
        settings = {"tree": (kernel, kernel.fma, kernel.amx_min_rows[torch.int8]),
                    other: (other_kernel, other_kernel.fma and not args.fma_off,
                            10**9 if args.amx_off else other_kernel.amx_min_rows[torch.int8])}
        print(f"{args.shape}, {args.layers} layer(s), int8: {nbytes / 1e6:.1f} MB of weights, "
              f"{torch.get_num_threads()} threads")
        print(f"| rows | {other} ms | tree ms | tree / {other} speed | tree GB/s |\n|---|---|---|---|---|")
        for rows in map(int, args.rows.split(",")):
            xs = {i: torch.randn(rows, i, generator=g).to(torch.bfloat16) for _, i in SHAPES[args.shape]}
            times: dict[str, list[float]] = {name: [] for name in settings}
            for r in range(args.rounds + 2):
                for name in (("tree", other) if r % 2 else (other, "tree")):
                    kern, fma, amx_rows = settings[name]
                    kern.fma, kern.amx_min_rows[torch.int8] = fma, amx_rows
                    t0 = time.perf_counter()
                    for layer in layers:
                        for packed, scale, n, k in layer:
                            kern(xs[k], packed, None, n, scale)
                    if r >= 2:  # two warm-up rounds
                        times[name].append(time.perf_counter() - t0)
            mine, theirs = statistics.median(times["tree"]), statistics.median(times[other])
            print(f"| {rows} | {theirs * 1e3:.2f} | {mine * 1e3:.2f} | {theirs / mine:.2f}x | "
                  f"{nbytes / mine / 1e9:.1f} |", flush=True)
        kernel.fma = settings["tree"][1]


if __name__ == "__main__":
    main()
