"""Decode on a shared CPU: single-stream tok/s quiet, then with other processes spinning on cores.

    python benchmarks/contention.py MODEL [--busy 1] [--threads 2] [--policies default,passive,1thread]
                                         [--llamacpp GGUF] [--rounds 2] [--tokens 64]

Each variant runs in its own process (OpenMP reads its environment once), loads MODEL in bf16, warms up,
then decodes --tokens greedy tokens after a short prompt (`ignore_eos`), quiet and with --busy spinner
processes (one pure-Python busy loop each), in alternating rounds. The result is the share of its quiet
speed that each variant keeps, which is what a CPU server sharing its cores meets every day:

- `default`: --threads torch threads, OpenMP's default wait policy (what llmopt did before `--threads`);
- `passive`: the same with OMP_WAIT_POLICY=passive (waiting threads sleep instead of spinning);
- `1thread`: one thread;
- `auto`: llmopt's `--threads auto` (threads sized to the cores that are free when the engine starts);
- llama.cpp's llama-server on --llamacpp GGUF with --threads threads, when given.

Decode speed is 64 / (time of 65 tokens - time of 1 token), i.e. prefill excluded. Absolute numbers on a
shared machine are noise; the shares within one run are the result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "The history of the printing press begins"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
import peers_servers as ps  # noqa: E402


def _child(model: str, threads: str, tokens: int) -> None:
    """Runs in the variant's process: load, warm up, then one decode speed per line read from stdin."""
    from llmopt import LLM, SamplingParams

    llm = LLM(model, dtype="bfloat16", kv_cache_memory="256MiB", num_threads=threads)
    import torch

    print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)

    def run(n: int) -> float:
        t = time.perf_counter()
        llm.generate(PROMPT, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - t

    run(4)
    for _ in sys.stdin:
        t1 = min(run(1) for _ in range(2))
        tn = run(tokens + 1)
        print(json.dumps({"tok_s": tokens / max(tn - t1, 1e-9)}), flush=True)


class Variant:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str]):
        self.name = name
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        first = json.loads(self.proc.stdout.readline())
        self.threads = first.get("threads")

    def measure(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["tok_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


class LlamaServer:
    """llama-server on a GGUF: decode speed from the server's own timings for the same greedy tokens."""

    def __init__(self, gguf: str, threads: int, tokens: int):
        self.name, self.threads, self.tokens = "llama.cpp", threads, tokens
        self.port = ps.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = ps.llamacpp_command(gguf, self.port, threads=threads, slots=1, ctx_per_slot=512)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ps.wait_healthy(self.url, self.proc, 300)
        self.measure()  # warm-up

    def measure(self) -> float:
        return ps.llamacpp_decode_rate(self.url, PROMPT, self.tokens, 600)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def spinners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


SETTLE_S = 1.5  # `auto` decides by the last half second's load (threads.LoadSampler): the previous variant's run is in it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy", type=int, default=1, help="spinner processes in the busy phase")
    ap.add_argument("--policies", default="default,passive,1thread,auto")
    ap.add_argument("--llamacpp", help="a GGUF of the same model for llama-server (needs make bench-peers)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "THREADS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child[0], args.child[1], args.tokens)
        return
    if not args.model:
        ap.error("MODEL is required")
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    specs = {"default": (str(args.threads), {}), "passive": (str(args.threads), {"OMP_WAIT_POLICY": "passive"}),
             "1thread": ("1", {}), "auto": ("auto", {})}
    variants = []
    for p in args.policies.split(","):
        threads, extra = specs[p]
        cmd = [sys.executable, __file__, "--child", args.model, threads, "--tokens", str(args.tokens)]
        variants.append(Variant(p, cmd, {**base, **extra}))
    if args.llamacpp:
        variants.append(LlamaServer(args.llamacpp, args.threads, args.tokens))
    quiet: dict[str, list[float]] = {v.name: [] for v in variants}
    busy: dict[str, list[float]] = {v.name: [] for v in variants}
    try:
        for r in range(args.rounds):
            for v in variants:
                time.sleep(SETTLE_S)  # the variant before it has just stopped: a quiet second before measuring
                quiet[v.name].append(v.measure())
            procs = spinners(args.busy)
            time.sleep(1)
            try:
                for v in variants:
                    busy[v.name].append(v.measure())
            finally:
                for p in procs:
                    p.kill()
            print(f"round {r + 1}: " + ", ".join(f"{v.name} {quiet[v.name][-1]:.1f}/{busy[v.name][-1]:.1f}"
                                                  for v in variants), flush=True)
    finally:
        for v in variants:
            v.close()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    print(f"\n{args.model}, {os.cpu_count()} CPUs ({cpu}), {args.busy} busy process(es), {args.rounds} rounds")
    print("| variant | threads | quiet tok/s | busy tok/s | share of quiet |\n|---|---|---|---|---|")
    for v in variants:
        q, b = statistics.median(quiet[v.name]), statistics.median(busy[v.name])
        print(f"| {v.name} | {v.threads} | {q:.2f} | {b:.2f} | {100 * b / q:.0f}% |")


if __name__ == "__main__":
    main()
