"""One GPTQ call (`gptq_quantize`: act-order, static groups, the weighted range search) at the linear shapes of
real models: seconds, and the output error tr((W-Q)·H·(W-Q)ᵀ) / tr(W·H·Wᵀ) it leaves, for this tree, this tree
with the range search in torch (its C kernel's loader answering None, as where it cannot be built), and
optionally an earlier tree (`--before DIR`, e.g. a `git worktree` of an older commit). Each call runs in its own
process, the sides alternating within every round; medians over the rounds.

    OMP_NUM_THREADS=2 python benchmarks/gptq_call.py --shapes 5632x2048,2048x5632 --before /work/before

Weights and the Hessian's inputs are random (Gaussian, 8 heavy input columns, 2,048 rows): time does not depend
on the values. Codes are compared with this tree's: GPTQ feeds every rounding back into the columns after it,
so a float32 difference anywhere can move later codes; the output error says whether it matters.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = "2048x2048,5632x2048,2048x5632,14336x4096,4096x14336"  # 1.2B Llama: q/o, gate/up, down; Llama-3-8B: MLP
ROOT = Path(__file__).resolve().parent.parent


def one_call(shape: str, group_size: int, codes_out: str, torch_search: bool) -> None:
    """The measured call, in this process (the tree on PYTHONPATH is the one measured); prints JSON."""
    import time

    import torch

    from llmopt.quant.gptq import gptq_quantize
    from llmopt.quant.scheme import QuantScheme

    if torch_search:
        from llmopt.quant import range_search_kernel
        range_search_kernel.load = lambda: None
    out, inp = (int(v) for v in shape.split("x"))
    g = torch.Generator().manual_seed(out + inp)
    w = torch.randn(out, inp, generator=g) * 0.02
    x = torch.randn(2048, inp, generator=g)
    x[:, :8] *= 20
    H = x.t() @ x / x.shape[0]
    del x
    t = time.perf_counter()
    qw, _ = gptq_quantize(w, [H.clone()], QuantScheme(bits=4, group_size=group_size), mse_observer=True)
    seconds = time.perf_counter() - t
    d = w - qw.dequantize(torch.float32)
    error = float(((d @ H) * d).sum() / ((w @ H) * w).sum())
    torch.save(qw.q.contiguous(), codes_out)
    print(json.dumps({"seconds": seconds, "error": error}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="OUTxIN weights, comma-separated")
    ap.add_argument("--group-sizes", default="128")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--before", default=None, help="an earlier source tree to measure beside this one")
    ap.add_argument("--no-torch-search", action="store_true", help="leave out the side with the range search in torch")
    ap.add_argument("--one", nargs=4, metavar=("SHAPE", "GROUP", "CODES", "TORCH_SEARCH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        shape, gs, codes, torch_search = args.one
        one_call(shape, int(gs), codes, torch_search == "1")
        return
    import torch

    sides = {"now": (str(ROOT), "0")}
    if not args.no_torch_search:
        sides["now, range search in torch"] = (str(ROOT), "1")
    if args.before:
        sides["before"] = (str(Path(args.before).resolve()), "0")  # as it ran then
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; sides: {', '.join(sides)}")
    print("| shape | group | " + " | ".join(f"{s}: s (output error)" for s in sides) + " | codes differing from now |")
    print("|---|---|" + "---|" * len(sides) + "---|")
    with tempfile.TemporaryDirectory(prefix="gptq-call-") as tmp:
        for shape in args.shapes.split(","):
            for gs in args.group_sizes.split(","):
                runs: dict[str, list[dict]] = {s: [] for s in sides}
                for _ in range(args.rounds):
                    for side, (tree, torch_search) in sides.items():
                        codes = f"{tmp}/{len(runs[side])}-{abs(hash(side))}.pt"
                        env = {**os.environ, "PYTHONPATH": tree}
                        cmd = [sys.executable, str(ROOT / "benchmarks" / "gptq_call.py"), "--one", shape, gs, codes,
                               torch_search]
                        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                        runs[side].append({**json.loads(out.strip().splitlines()[-1]), "codes": codes})
                now = torch.load(runs["now"][-1]["codes"])
                cells, differ = [], []
                for side, rs in runs.items():
                    cells.append(f"{statistics.median(r['seconds'] for r in rs):.2f} ({rs[-1]['error']:.4e})")
                    if side != "now":
                        q = torch.load(rs[-1]["codes"])
                        differ.append(f"{side} {100 * float((q != now).float().mean()):.3f}%")
                print(f"| {shape} | {gs} | " + " | ".join(cells) + f" | {'; '.join(differ)} |", flush=True)


if __name__ == "__main__":
    main()
