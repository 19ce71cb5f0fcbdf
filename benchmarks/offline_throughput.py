"""Offline engine benchmarks, measured side by side in ONE run on the same machine, model and dtype.

    python benchmarks/offline_throughput.py --dtype float32 [--model smollm2-135m|gemma3-270m]
        [--only mixed,single,prefix,overhead] [--num-requests 64] [--enforce-eager] [--decode-step native|eager]
        [--skip-transformers]

- mixed:    64 requests (`--num-requests`), prompts 32-512 tokens, outputs 16-256 (ignore_eos). llmopt continuous batching
            vs transformers static batches of 16 in arrival order, each run to its longest request.
            Reports useful output tokens/s (requested tokens only).
- single:   single-stream decode tok/s, llmopt vs transformers generate.
- prefix:   32 requests sharing an 800-token system prompt; TTFT p50 with and without prefix caching.
- overhead: CPU-side scheduling/bookkeeping share of step time at batch 32.
Absolute numbers on shared machines are noise; the ratios are the result.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from llmopt import LLM, SamplingParams


def mixed_workload(vocab: int, n: int = 64, seed: int = 0):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen, olen = rng.randint(32, 512), rng.randint(16, 256)
        reqs.append(([rng.randrange(100, vocab - 1) for _ in range(plen)], olen))
    return reqs


def hf_model(llm: LLM, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.weights_dir), dtype=dtype)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def hf_static(hf, reqs, batch: int) -> float:
    """Static batching: left-padded batches in arrival order, each run to its longest request."""
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(reqs), batch):
            chunk = reqs[i:i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, (p, _) in enumerate(chunk):
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            hf.generate(ids, attention_mask=mask, max_new_tokens=max(o for _, o in chunk), do_sample=False)
    return time.perf_counter() - t0


def bench_mixed(llm: LLM, hf, results: dict, n: int = 64) -> None:
    reqs = mixed_workload(llm.engine.spec.vocab_size, n=n)
    useful = sum(o for _, o in reqs)
    llm.generate([p for p, _ in reqs[:4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.engine.reset_prefix_cache()
    stats: list = []
    llm.engine.stat_listeners.append(stats.append)
    t0 = time.perf_counter()
    llm.generate([p for p, _ in reqs], [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
                                        for _, o in reqs])
    ours = time.perf_counter() - t0
    llm.engine.stat_listeners.remove(stats.append)
    theirs = hf_static(hf, reqs, 16) if hf is not None else None
    results["mixed"] = {"requests": n, "useful_output_tokens": useful, "llmopt_s": ours, "transformers_static16_s": theirs,
                        "llmopt_tok_s": useful / ours, "transformers_tok_s": theirs and useful / theirs,
                        "speedup": theirs and theirs / ours,
                        "llmopt_prefill_steps_s": sum(st.step_time for st in stats if st.num_prefill_tokens),
                        "llmopt_decode_only_steps_s": sum(st.step_time for st in stats if not st.num_prefill_tokens)}


def bench_single(llm: LLM, hf, results: dict, new_tokens: int = 128, rounds: int = 3) -> None:
    """Decode tok/s after the first token; `rounds` interleaved runs per side, best of each kept (the
    machine is shared, so the best run is the one least disturbed)."""
    prompt = llm.get_tokenizer().encode("Write a short story about a robot who learns to paint.")
    p = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    x = torch.tensor([prompt])
    ours_runs, theirs_runs = [], []
    with torch.no_grad():
        hf.generate(x, max_new_tokens=8, do_sample=False)
        for _ in range(rounds):
            m = llm.generate([prompt], p)[0].metrics
            ours_runs.append((new_tokens - 1) / (m.finished_time - m.first_token_time))
            t0 = time.perf_counter()
            hf.generate(x, max_new_tokens=1, do_sample=False)
            t_first = time.perf_counter() - t0
            t0 = time.perf_counter()
            hf.generate(x, max_new_tokens=new_tokens, do_sample=False)
            total = time.perf_counter() - t0
            theirs_runs.append((new_tokens - 1) / max(total - t_first, 1e-9))
    ours, theirs = max(ours_runs), max(theirs_runs)
    results["single"] = {"llmopt_decode_tok_s": ours, "transformers_decode_tok_s": theirs,
                         "speedup": ours / theirs, "rounds": rounds,
                         "llmopt_runs": ours_runs, "transformers_runs": theirs_runs}


def bench_prefix(llm_args: dict, results: dict, n: int = 32, system_len: int = 800) -> None:
    rng = random.Random(1)
    out = {}
    for caching in (False, True):
        llm = LLM(**llm_args, enable_prefix_caching=caching)
        vocab = llm.engine.spec.vocab_size
        system = [rng.randrange(100, vocab - 1) for _ in range(system_len)]
        warm = [rng.randrange(100, vocab - 1) for _ in range(40)]
        llm.generate([warm], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        reqs = [system + [rng.randrange(100, vocab - 1) for _ in range(rng.randint(20, 60))] for _ in range(n)]
        outs = llm.generate(reqs, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        ttfts = [o.metrics.ttft for o in outs]
        out["cached" if caching else "uncached"] = {"ttft_p50_ms": statistics.median(ttfts) * 1000,
                                                    "hit_tokens": llm.engine.block_manager.prefix_hits}
        del llm
    out["ttft_p50_reduction_pct"] = 100 * (1 - out["cached"]["ttft_p50_ms"] / out["uncached"]["ttft_p50_ms"])
    results["prefix"] = out


def bench_overhead(llm: LLM, results: dict, batch: int = 32) -> None:
    stats = []
    llm.engine.stat_listeners.append(stats.append)
    reqs = mixed_workload(llm.engine.spec.vocab_size, n=batch, seed=3)
    llm.generate([p[:64] for p, _ in reqs], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    llm.engine.stat_listeners.remove(stats.append)
    decode = [s for s in stats if s.batch_size == batch and s.num_prefill_tokens == 0]
    step = sum(s.step_time for s in decode)
    results["overhead"] = {
        "decode_steps": len(decode), "batch": batch,
        "mean_step_ms": 1000 * step / len(decode),
        "schedule_pct": 100 * sum(s.schedule_time for s in decode) / step,
        "prepare_pct": 100 * sum(s.prepare_time for s in decode) / step,
        "postprocess_pct": 100 * sum(s.postprocess_time for s in decode) / step,
        "forward_pct": 100 * sum(s.forward_time for s in decode) / step,
        "sample_pct": 100 * sum(s.sample_time for s in decode) / step,
        "overhead_pct": 100 * sum(s.overhead_time for s in decode) / step,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--only", default="mixed,single,prefix,overhead")
    ap.add_argument("--num-requests", type=int, default=64, help="requests in the mixed workload")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="llmopt without its compiled prefill kernels and packed CPU weights")
    ap.add_argument("--decode-step", default="native", choices=["native", "eager"],
                    help="llmopt's decode step: one native call (default) or layer by layer")
    ap.add_argument("--skip-transformers", action="store_true",
                    help="mixed: llmopt alone (comparing two llmopt builds; transformers' static batches take minutes)")
    args = ap.parse_args()
    which = set(args.only.split(","))
    llm_args = {"model": args.model, "dtype": args.dtype, "enforce_eager": args.enforce_eager,
                "decode_step": args.decode_step}
    llm = LLM(**llm_args, max_num_seqs=64)
    hf = hf_model(llm, llm.engine.dtype) if which & {"single"} or (
        "mixed" in which and not args.skip_transformers) else None
    results: dict = {"model": args.model, "dtype": args.dtype, "torch_threads": torch.get_num_threads()}
    if "single" in which:
        bench_single(llm, hf, results)
        print(json.dumps(results["single"]), flush=True)
    if "overhead" in which:
        bench_overhead(llm, results)
        print(json.dumps(results["overhead"]), flush=True)
    if "mixed" in which:
        bench_mixed(llm, None if args.skip_transformers else hf, results, n=args.num_requests)
        print(json.dumps(results["mixed"]), flush=True)
    if "prefix" in which:
        del llm
        bench_prefix(llm_args, results)
        print(json.dumps(results["prefix"]), flush=True)
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
