"""How fast our bf16 linear kernel reads its weights, by storage and rows, against the DRAM read rate.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/linear_rates.py [--rows 1,2,4,8,16,32] [--rounds 5]

A decode step is bound by how fast the weights stream from memory: this says, on the CPU at hand, how close each
storage's passes (bf16, int8 per channel, int4 in groups of 128; AVX512-BF16, AMX or the AVX2 float32 passes,
whichever `bf16_linear.c` runs here) come to the read rate, and where they turn compute-bound as rows grow. The
weights are four 1.2B-shape decoder layers' linears (about 270 MB in bf16, far past the caches), called in turn as
a decode step calls them; GB/s is packed weight (and scale) bytes over the best round's time, and "G products/s"
is weights x rows over it (2 flops each).
"""

from __future__ import annotations

import argparse
import time

import torch
from big_model import read_bandwidth  # benchmarks/

from llmopt.layers.packed_linear import pack_int4_vnni, pack_vnni, vnni_kernel

SHAPES = [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)] * 4  # 1.2B shape: q|k|v, o, gate|up, down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    kernel = vnni_kernel()
    if kernel is None:
        raise SystemExit("our bf16 kernel does not run here (no AVX512-BF16 or AVX2, or no C compiler)")
    g = torch.Generator().manual_seed(0)
    layers = []
    for n, k in SHAPES:
        int4, gscale = pack_int4_vnni(torch.randint(0, 16, (n, k), generator=g),
                                      torch.rand(n, k // 128, generator=g) * 0.01)
        layers.append({"n": n, "k": k, "bf16": pack_vnni(torch.randn(n, k, generator=g).to(torch.bfloat16)),
                       "int8": pack_vnni(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)),
                       "scale": torch.rand(n, generator=g).to(torch.bfloat16), "int4": int4, "gscale": gscale})
    weights = sum(n * k for n, k in SHAPES)
    nbytes = {"bf16": 2 * weights, "int8": weights, "int4": weights // 2 + sum(t["gscale"].numel() * 2 for t in layers)}

    def call(storage: str, t: dict, x: torch.Tensor) -> None:
        if storage == "bf16":
            kernel(x, t["bf16"], None, t["n"])
        elif storage == "int8":
            kernel(x, t["int8"], None, t["n"], t["scale"])
        else:
            kernel.int4(x, t["int4"], t["gscale"], 128, None, t["n"])

    bandwidth = read_bandwidth()
    print(f"kernel passes: {kernel.isa}{' + AMX' if kernel.amx else ''}, {torch.get_num_threads()} threads; "
          f"DRAM read {bandwidth / 1e9:.1f} GB/s; {nbytes['bf16'] / 1e6:.0f} MB of bf16 weights per round\n")
    print("| rows | " + " | ".join(f"{s} GB/s (share of read) | {s} G products/s" for s in nbytes) + " |")
    print("|---" * (1 + 2 * len(nbytes)) + "|")
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for k in {t["k"] for t in layers}}
        cells = []
        for storage, size in nbytes.items():
            best = float("inf")
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                for t in layers:
                    call(storage, t, xs[t["k"]])
                best = min(best, time.perf_counter() - t0)
            cells += [f"{size / best / 1e9:.1f} ({size / best / bandwidth:.0%})", f"{weights * rows / best / 1e9:.1f}"]
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
