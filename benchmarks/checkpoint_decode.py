"""Single-stream decode of several checkpoints side by side: does a checkpoint decode at the speed of its bytes?

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/checkpoint_decode.py DIR [DIR ...] [--tokens 128] [--rounds 4]

Every checkpoint is loaded once, into one process, as `llmopt serve` loads it (bf16 activations, the native
decode step). Rounds alternate their order (A B C, C B A, ...), so a drift of the machine's speed during the
run (this project's VMs drift by several percent over minutes) falls on every checkpoint alike; one 64-token
run per checkpoint, each in its own process minutes apart, cannot tell a 10% difference from that drift.
Each round is greedy decode of --tokens tokens after a 32-token prompt. Reported per checkpoint: the bytes of
its safetensors, the median tok/s and each round's, the ratio to the first checkpoint, and one profiled run
(ms per token: all, inside the step's linears and attention, and the lm_head), from decode_step.py's profile.
A mixed `--scheme auto` checkpoint against uniform ones of about its size is what this was written for
(docs/BENCHMARKS.md, "a mixed checkpoint decodes at the speed of its bytes"). Memory: every model at once, each
with a KV pool of --kv-cache-memory (the engine's 2 GiB default, times four models of the 8B layer shape, ran
this machine out of memory).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from decode_step import PROMPT, profile_single_stream


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoints", nargs="+", help="checkpoint folders (the first is the reference of the ratios)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kv-cache-memory", default="256MiB", help="each model's KV pool (default: 256MiB)")
    args = ap.parse_args()
    missing = [p for p in args.checkpoints if not Path(p).is_dir()]
    if missing:
        raise SystemExit(f"not a checkpoint folder: {', '.join(missing)}")

    import torch

    from llmopt import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llms = {p: LLM(p, dtype="bfloat16", kv_cache_memory=args.kv_cache_memory) for p in args.checkpoints}
    for p, llm in llms.items():
        if llm.engine.runner.decode_step is None:
            raise SystemExit(f"{p}: the native decode step did not build, so this would time the eager one")
        llm.generate([PROMPT], params, use_tqdm=False)  # warm-up: kernel builds, first-call costs
    speed: dict[str, list[float]] = {p: [] for p in args.checkpoints}
    for rnd in range(args.rounds):
        for p in args.checkpoints if rnd % 2 == 0 else args.checkpoints[::-1]:
            t = time.perf_counter()
            llms[p].generate([PROMPT], params, use_tqdm=False)
            speed[p].append(args.tokens / (time.perf_counter() - t))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.tokens} tokens after a 32-token "
          f"prompt, single stream, median of {args.rounds} alternating rounds\n")
    print("| checkpoint | MB | tok/s (each round) | vs the first | ms/token: all / linears / attention / lm_head |")
    print("|---|---|---|---|---|")
    first = statistics.median(speed[args.checkpoints[0]])
    for p in args.checkpoints:
        size = sum(f.stat().st_size for f in Path(p).glob("*.safetensors")) / 1e6
        total, ops, head = profile_single_stream(llms[p], PROMPT, params, args.tokens)
        med = statistics.median(speed[p])
        rounds = ", ".join(f"{s:.1f}" for s in speed[p])
        print(f"| {Path(p).name} | {size:.4g} | {med:.1f} ({rounds}) | {med / first:.2f}x | "
              f"{total:.2f} / {ops['linear']:.2f} / {ops['attend']:.2f} / {head:.2f} |", flush=True)


if __name__ == "__main__":
    main()
