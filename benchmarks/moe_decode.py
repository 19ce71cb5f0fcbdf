"""MoE decode speed, measured side by side in one run: decode tokens/s of a random Qwen3-MoE through our engine
in up to three ways, and through transformers' `generate` (which runs its experts through `grouped_mm`), at each
batch size. Each number is the best of `--repeats` runs.

    OMP_NUM_THREADS=2 python benchmarks/moe_decode.py [--dtype bfloat16] [--batches 1,8,32] [--json out.json]

Our variants (`--variants`):
- `step`: the engine as it runs by default. bf16 on a CPU with AVX512-BF16: each sparse block is one C call
  (`llmopt/layers/moe_block.c`) and decode steps run as one native call (`llmopt/step/`); fp32: the block's
  `grouped_mm` path, layer by layer.
- `eager`: `decode_step="eager"`, layer by layer (bf16: the same C block, called from Python per layer).
- `torch`: a no-op hook on every router, which sends each block to its torch path (bf16: one packed matmul per
  expert that got tokens; fp32: `grouped_mm`) and keeps the decode step from lowering the model.

The checkpoint is written by transformers itself (`llmopt.testing.tiny_model.write_tiny_moe`). Both
sides decode the same equal-length random prompts greedily for `--new-tokens` tokens (no EOS stop).
Decode time: ours from the request metrics (first token → last token); transformers' as the time of
`generate(max_new_tokens=N)` minus that of `generate(max_new_tokens=1)` (prefill + first token).
With `--check` the greedy tokens of every variant are compared (fp32 only: bf16 near-ties may flip).
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


def ours(model_dir: str, prompts: list[list[int]], new_tokens: int, dtype: str, variant: str,
         repeats: int) -> tuple[float, list[list[int]]]:
    from llmopt.layers.moe import SparseMoeBlock

    llm = LLM(model_dir, dtype=dtype, device="cpu", max_num_seqs=max(len(prompts), 1), enable_prefix_caching=False,
              decode_step="eager" if variant == "eager" else "native")
    if variant == "torch":  # a hook on each router: the block's torch path, and no decode step
        for m in llm.engine.model.modules():
            if isinstance(m, SparseMoeBlock):
                m.gate.register_forward_pre_hook(lambda mod, args: None)
        runner = llm.engine.runner
        if runner.decode_step is not None:
            from llmopt.step import DecodeStep

            runner.decode_step = DecodeStep.build(llm.engine.model, runner.cache, runner.attn_backend)
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
    ap.add_argument("--variants", default="step,eager,torch", help="ours, in this order (module doc)")
    ap.add_argument("--no-transformers", action="store_true", help="leave transformers out")
    ap.add_argument("--scheme", choices=["w8a16", "w4a16"], default=None,
                    help="quantize the experts and projections first (RTN; w4a16 in groups of 128); transformers is "
                         "then left out")
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
    variants = [v for v in args.variants.split(",") if v]
    if not set(variants) <= {"step", "eager", "torch"}:
        raise SystemExit(f"--variants: step, eager or torch, not {args.variants!r}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny_moe(tmp, model_type="qwen3_moe", num_layers=args.layers, hidden_size=args.hidden,
                                       num_heads=8, num_kv_heads=4, num_experts=args.experts, top_k=args.top_k,
                                       expert_intermediate_size=args.expert_width))
        cfg = json.loads(open(f"{model_dir}/config.json").read())
        if args.scheme:
            from llmopt.quant.pipeline import quantize_model
            from llmopt.quant.recipe import QuantizeConfig

            out = f"{tmp}/{args.scheme}"
            quantize_model(QuantizeConfig(model=model_dir, output=out, scheme=args.scheme, method="rtn",
                                          group_size=128 if args.scheme == "w4a16" else None, device="cpu"))
            model_dir, args.no_transformers = out, True
        rng = random.Random(0)
        rows = []
        for b in (int(v) for v in args.batches.split(",")):
            prompts = [[rng.randrange(3, cfg["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(b)]
            row: dict = {"batch": b}
            ids = []
            for v in variants:
                tps, got = ours(model_dir, prompts, args.new_tokens, args.dtype, v, args.repeats)
                row[f"llmopt_{v}_tok_s"] = round(tps, 1)
                ids.append(got)
            if not args.no_transformers:
                hf_tps, hf_ids = transformers_decode(model_dir, prompts, args.new_tokens, args.dtype, args.repeats)
                row["transformers_tok_s"] = round(hf_tps, 1)
                for v in variants:
                    row[f"{v}_vs_transformers"] = round(row[f"llmopt_{v}_tok_s"] / hf_tps, 2)
                ids.append(hf_ids)
            if args.check:
                row["same_tokens"] = all(i == ids[0] for i in ids)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"model": f"random Qwen3-MoE: hidden {args.hidden}, {args.layers} layers, {args.experts} experts of "
                       f"{args.expert_width}, top-{args.top_k}", "dtype": args.dtype, "scheme": args.scheme,
              "threads": torch.get_num_threads(), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "rows": rows}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
