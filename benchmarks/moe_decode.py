"""MoE routing cost, measured side by side in one run: decode tokens/s of a small random Qwen3-MoE
through our engine — tokens grouped by expert, then either `grouped_mm` over the packed expert weights
(the default while experts are float) or one matmul per expert that got tokens (the path quantized
experts take) — and through transformers' `generate` (transformers 5 runs its experts through
`grouped_mm` too), at batch 1 and batch 32. Each number is the best of `--repeats` runs.

    OMP_NUM_THREADS=1 python benchmarks/moe_decode.py [--batches 1,32] [--dtype float32] [--json out.json]

The checkpoint is written by transformers itself (`llmopt.testing.tiny_model.write_tiny_moe`). Both
sides decode the same equal-length random prompts greedily for `--new-tokens` tokens (no EOS stop).
Decode time: ours from the request metrics (first token → last token); transformers' as the time of
`generate(max_new_tokens=N)` minus that of `generate(max_new_tokens=1)` (prefill + first token).
With `--check` the greedy tokens of both sides are compared (fp32 only: bf16 near-ties may flip).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch

from llmopt import LLM, SamplingParams
from llmopt.testing.tiny_model import write_tiny_moe


def ours(model_dir: str, prompts: list[list[int]], new_tokens: int, dtype: str, loop: bool,
         repeats: int) -> tuple[float, list[list[int]]]:
    from llmopt.layers.moe import SparseMoeBlock

    llm = LLM(model_dir, dtype=dtype, device="cpu", max_num_seqs=max(len(prompts), 1), enable_prefix_caching=False)
    if loop:  # the per-expert loop that quantized experts take
        for m in llm.engine.model.modules():
            if isinstance(m, SparseMoeBlock):
                m._grouped_broken = True
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    best = 0.0
    for _ in range(repeats):
        outs = llm.generate(prompts, params)
        first = min(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.finished_time for o in outs)
        decoded = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        best = max(best, decoded / (last - first))
    return best, [o.outputs[0].token_ids for o in outs]


def transformers_decode(model_dir: str, prompts: list[list[int]], new_tokens: int, dtype: str,
                        repeats: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    x = torch.tensor(prompts)
    mask = torch.ones_like(x)

    def gen(n: int) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        with torch.no_grad():
            y = hf.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0, y

    gen(4)  # warm-up
    best = 0.0
    for _ in range(repeats):
        t1, _ = gen(1)
        tn, y = gen(new_tokens)
        best = max(best, len(prompts) * (new_tokens - 1) / (tn - t1))
    return best, y[:, x.shape[1]:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-width", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="compare greedy tokens (fp32)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny_moe(tmp, model_type="qwen3_moe", num_layers=args.layers, hidden_size=args.hidden,
                                       num_heads=8, num_kv_heads=4, num_experts=args.experts, top_k=args.top_k,
                                       expert_intermediate_size=args.expert_width))
        cfg = json.loads(open(f"{model_dir}/config.json").read())
        rng = random.Random(0)
        rows = []
        for b in (int(v) for v in args.batches.split(",")):
            prompts = [[rng.randrange(3, cfg["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(b)]
            our_tps, our_ids = ours(model_dir, prompts, args.new_tokens, args.dtype, False, args.repeats)
            loop_tps, loop_ids = ours(model_dir, prompts, args.new_tokens, args.dtype, True, args.repeats)
            hf_tps, hf_ids = transformers_decode(model_dir, prompts, args.new_tokens, args.dtype, args.repeats)
            row = {"batch": b, "llmopt_grouped_mm_tok_s": round(our_tps, 1), "llmopt_loop_tok_s": round(loop_tps, 1),
                   "transformers_tok_s": round(hf_tps, 1), "speedup_grouped_mm": round(our_tps / hf_tps, 2),
                   "speedup_loop": round(loop_tps / hf_tps, 2)}
            if args.check:
                row["same_tokens"] = our_ids == hf_ids == loop_ids
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"model": f"random Qwen3-MoE: hidden {args.hidden}, {args.layers} layers, {args.experts} experts of "
                       f"{args.expert_width}, top-{args.top_k}", "dtype": args.dtype,
              "threads": torch.get_num_threads(), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "rows": rows}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
