"""W8A16 decode: our int8 kernel against torch's `_weight_int8pack_mm`, side by side in one process.

    python benchmarks/int8_decode.py [--threads 1] [--rows 1,2,4,8,16,32,64,128,256] [--engine CHECKPOINT]

- matmuls: SmolLM2-135M's 120 decoder linears (random int8 weights, distinct tensors, so they stream
  from memory as in a decode step) at each row count: `_weight_int8pack_mm`, our kernel, and the
  weight dequantized per call by the kernel's library + one dense matmul (what `Int8WeightOnlyLinear`
  runs past MAX_ROWS).
  Best of 3 rounds, the variants interleaved within each round.
- engine (with --engine, a W8A16 checkpoint from `llmopt quantize --scheme w8a16`): bf16 greedy decode
  of 128 tokens after a 32-token prompt, one sequence and a batch of 8, with the kernel on and off
  (`use_native_int8_kernel`) in alternating rounds of one process; median tok/s of 3 rounds each, and
  whether the greedy tokens are the same.
Absolute numbers on shared machines are noise; the ratios are the result.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from llmopt.quant import int8_kernel

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # qkv, o, gate|up, down; 30 layers


def matmuls(rows: list[int]) -> None:
    kernel = int8_kernel.load()
    if kernel is None:
        raise SystemExit("the int8 kernel could not be built here (see the warning)")
    g = torch.Generator().manual_seed(0)
    ws = [torch.randint(-128, 128, s, generator=g, dtype=torch.int8) for s in SHAPES]
    ss = [(torch.rand(s[0], generator=g) / 50).to(torch.bfloat16) for s in SHAPES]
    nbytes = sum(w.numel() for w in ws)
    variants = {
        "_weight_int8pack_mm": lambda x, w, s: torch.ops.aten._weight_int8pack_mm(x, w, s),
        "ours": kernel,
        "dequant + matmul": lambda x, w, s: F.linear(x, kernel.dequantize(w, s)),
    }
    print(f"{len(SHAPES)} linears, {nbytes / 1e6:.1f} MB of int8 weights, {torch.get_num_threads()} thread(s)")
    print("| rows | " + " | ".join(f"{k} ms (GB/s)" for k in variants) + " | ours / int8pack |")
    print("|---" * (len(variants) + 2) + "|")
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for k in (576, 1536)}
        best = dict.fromkeys(variants, float("inf"))
        for _ in range(3):
            for name, fn in variants.items():
                t = time.perf_counter()
                for w, s in zip(ws, ss, strict=True):
                    fn(xs[w.shape[1]], w, s)
                best[name] = min(best[name], time.perf_counter() - t)
        cells = " | ".join(f"{v * 1e3:.1f} ({nbytes / v / 1e9:.1f})" for v in best.values())
        print(f"| {m} | {cells} | {best['_weight_int8pack_mm'] / best['ours']:.2f}× |")


def engine(checkpoint: str) -> None:
    from llmopt import LLM, SamplingParams
    from llmopt.quant.linear import use_native_int8_kernel

    llm = LLM(checkpoint, dtype="bfloat16")
    model = llm.engine.runner.model
    prompt = list(range(100, 132))
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    speed: dict[tuple[bool, int], list[float]] = {}
    tokens: dict[tuple[bool, int], list[list[int]]] = {}
    llm.generate([prompt], params)  # warm-up: kernel build, first-call costs
    for rnd in range(3):
        for on in (False, True) if rnd % 2 == 0 else (True, False):
            use_native_int8_kernel(model, on)
            for batch in (1, 8):
                t = time.perf_counter()
                outs = llm.generate([prompt] * batch, params)
                speed.setdefault((on, batch), []).append(batch * 128 / (time.perf_counter() - t))
                tokens[(on, batch)] = [o.outputs[0].token_ids for o in outs]
    print("| sequences | torch's kernel tok/s | ours tok/s | ours / torch's | same greedy tokens |")
    print("|---|---|---|---|---|")
    for batch in (1, 8):
        off, on = (statistics.median(speed[(k, batch)]) for k in (False, True))
        same = sum(a == b for a, b in zip(tokens[(False, batch)], tokens[(True, batch)], strict=True))
        runs = f"{', '.join(f'{v:.1f}' for v in speed[(False, batch)])} / {', '.join(f'{v:.1f}' for v in speed[(True, batch)])}"
        print(f"| {batch} | {off:.1f} | {on:.1f} | {on / off:.2f}× | {same}/{batch} |  (rounds: {runs})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--engine", metavar="CHECKPOINT", help="also A/B a W8A16 checkpoint in the engine")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    matmuls([int(r) for r in a.rows.split(",")])
    if a.engine:
        engine(a.engine)


if __name__ == "__main__":
    main()
