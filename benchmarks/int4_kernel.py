"""W4A16 per decoder layer: our VNNI-panel int4 kernel against torch's tinygemm CPU kernel, side by side.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/int4_kernel.py [--shape 1b|8b] [--rows 1,4,16,64] [--rounds 20]

The four linears of one decoder layer of the shape (q|k|v, o, gate|up, down), symmetric int4 in groups of
128 from random weights, built as `Int4WeightOnlyLinear` twice: once on our kernel (the default where the
CPU has AVX512-BF16) and once on tinygemm (`_weight_int4pack_mm_for_cpu`). Rounds alternate the two, and the
median of each is kept; GB/s is the packed weights and scales read per call over that time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmopt.quant.linear import Int4WeightOnlyLinear
from llmopt.quant.rtn import rtn_quantize
from llmopt.quant.scheme import QuantScheme

SHAPES = {  # (out, in) of q|k|v, o, gate|up, down
    "1b": [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)],
    "8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
}


def build(out_f: int, in_f: int, tinygemm: bool) -> Int4WeightOnlyLinear:
    qw = rtn_quantize(torch.randn(out_f, in_f) * 0.02, QuantScheme(bits=4, group_size=128))
    if not tinygemm:
        return Int4WeightOnlyLinear.from_quantized(qw, None, torch.bfloat16, "cpu")
    build_vnni = Int4WeightOnlyLinear._build_vnni
    Int4WeightOnlyLinear._build_vnni = lambda self, qw, perm: False  # type: ignore[method-assign]
    try:
        return Int4WeightOnlyLinear.from_quantized(qw, None, torch.bfloat16, "cpu")
    finally:
        Int4WeightOnlyLinear._build_vnni = build_vnni  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    layers = {name: [build(o, i, name == "tinygemm") for o, i in SHAPES[args.shape]] for name in ("ours", "tinygemm")}
    assert all(m.mode == "cpu-vnni-int4" for m in layers["ours"]), "our kernel does not run on this CPU"
    nbytes = sum(m.weight_nbytes() for m in layers["ours"])
    print(f"{args.shape} layer, int4 g128: {nbytes / 1e6:.1f} MB of packed weights and scales, "
          f"{torch.get_num_threads()} threads")
    print("| rows | tinygemm ms | ours ms | ours / tinygemm speed | ours GB/s |\n|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        xs = [torch.randn(rows, i).to(torch.bfloat16) for _, i in SHAPES[args.shape]]
        times: dict[str, list[float]] = {"ours": [], "tinygemm": []}
        for r in range(args.rounds + 2):
            for name in (("ours", "tinygemm") if r % 2 else ("tinygemm", "ours")):
                t0 = time.perf_counter()
                for m, x in zip(layers[name], xs, strict=True):
                    m(x)
                if r >= 2:  # two warm-up rounds
                    times[name].append(time.perf_counter() - t0)
        ours, theirs = statistics.median(times["ours"]), statistics.median(times["tinygemm"])
        print(f"| {rows} | {theirs * 1e3:.2f} | {ours * 1e3:.2f} | {theirs / ours:.2f}x | {nbytes / ours / 1e9:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
