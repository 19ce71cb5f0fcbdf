"""One of our C kernels at a git revision against the tree's, in ONE engine process, on the mixed
workload (prompts 32-512 tokens, outputs 16-256, ignore_eos, at most --concurrency sequences at once).

    OMP_NUM_THREADS=1 python benchmarks/kernel_ab.py --kernel paged_decode --rev HEAD~1 \
        [--model smollm2-135m] [--dtype bfloat16] [--requests 24] [--rounds 4]

Rounds alternate A B B A ..., each pair on its own prompts (so the prefix cache never helps one side),
and the engine swaps the loaded library between rounds: same weights, same process, same load on the
machine. Output tokens/s per round, then the medians. Absolute figures on shared machines are noise;
the ratio is the result.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import llmopt.native as native
from llmopt import LLM, SamplingParams
from llmopt.layers import packed_linear
from llmopt.layers.attention import paged_decode_kernel
from llmopt.quant import Int8WeightOnlyLinear, int8_kernel
from llmopt.quant.packed_int8 import PackedInt8Linear
from llmopt.step import DecodeStep

KERNELS = {  # name -> (module that loads it, its wrapper class)
    "paged_decode": (paged_decode_kernel, paged_decode_kernel.PagedDecodeKernel),
    "int8_linear": (int8_kernel, int8_kernel.Int8LinearKernel),
    "bf16_linear": (packed_linear, packed_linear.Bf16LinearKernel),  # the same VNNI layout on both sides
}


def source_at(rev: str, path: Path, out: Path) -> Path:
    """The kernel's source file as it was at `rev`, written to `out`."""
    root = Path(__file__).resolve().parents[1]
    rel = path.resolve().relative_to(root)
    out.write_bytes(subprocess.run(["git", "-C", str(root), "show", f"{rev}:{rel}"], check=True,
                                   capture_output=True).stdout)
    return out


def use(llm: LLM, module, lib) -> None:
    """Make `lib` the loaded library of `module`'s kernel, and drop the engine's cached handles to it."""
    native._loaded[module.SOURCE] = lib
    for runner in (llm.engine.runner, llm.engine.draft_runner):
        if runner is not None and hasattr(runner.attn_backend, "_kernel"):
            runner.attn_backend._kernel = False  # the backend loads it again on its next decode
    for m in llm.engine.model.modules():
        if isinstance(m, Int8WeightOnlyLinear):
            m.native_kernel = m.native_kernel  # the setter forgets the resolved kernel
        elif (isinstance(m, (packed_linear.PackedLinear, PackedInt8Linear)) and m.kernel is not None
              and module is packed_linear):
            m.kernel = lib  # each module holds the kernel it packed for
        elif getattr(m, "mode", None) == "cpu-vnni-int4" and module is packed_linear:
            m._vnni = lib
    for runner in (llm.engine.runner, llm.engine.draft_runner):  # the native step holds the kernels' addresses
        if runner is not None and runner.decode_step is not None:
            runner.decode_step = DecodeStep.build(runner.model, runner.cache, runner.attn_backend)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=sorted(KERNELS), required=True)
    ap.add_argument("--rev", required=True, help="git revision of the A side (B is the working tree)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    module, wrapper = KERNELS[args.kernel]
    cc = native.compiler()
    if cc is None:
        raise SystemExit("no C compiler: the kernels cannot be built here")
    with tempfile.TemporaryDirectory(prefix="kernel-ab-") as tmp:
        old = source_at(args.rev, module.SOURCE, Path(tmp) / module.SOURCE.name)
        libs = {"A": wrapper(native.build(old, cc, Path(tmp))),
                "B": wrapper(native.build(module.SOURCE, cc, Path(tmp)))}
        llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.concurrency)
        order = (["A", "B", "B", "A"] * args.rounds)[: 2 * args.rounds]
        tps: dict[str, list[float]] = {"A": [], "B": []}
        for i, side in enumerate(order):
            use(llm, module, libs[side])
            rng = random.Random(1000 + i // 2)
            reqs = [([rng.randrange(100, 40000) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
                    for _ in range(args.requests)]
            llm.engine.reset_prefix_cache()
            t0 = time.perf_counter()
            llm.generate([p for p, _ in reqs], [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)
                                                for _, o in reqs], use_tqdm=False)
            tps[side].append(sum(o for _, o in reqs) / (time.perf_counter() - t0))
            print(f"round {i + 1} {side} ({args.rev if side == 'A' else 'tree'}): {tps[side][-1]:.1f} out tok/s",
                  flush=True)
    a, b = statistics.median(tps["A"]), statistics.median(tps["B"])
    print(f"{args.kernel} {args.model} {args.dtype} mixed c{args.concurrency} torch threads "
          f"{torch.get_num_threads()}: {args.rev} {a:.1f}, tree {b:.1f} out tok/s -> {b / a:.2f}x")


if __name__ == "__main__":
    main()
