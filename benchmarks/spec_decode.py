"""Speculative decoding, measured side by side in one run: single-stream decode with and without
speculation (n-gram prompt lookup, the layer-skip self-draft or a separate draft model such as a
W4A16 copy of the target), on input-grounded prompts and on open-ended chat prompts.

    python benchmarks/spec_decode.py --dtype bfloat16 [--method ngram|layer_skip|draft] [--k 4] [--max-tokens 128]
    llmopt quantize smollm2-135m --scheme w4a16 --group-size 64 -o /tmp/smollm2-w4
    python benchmarks/spec_decode.py --dtype bfloat16 --method draft --draft-model /tmp/smollm2-w4

Outputs are greedy, so they must be identical; the script checks it.
"""

from __future__ import annotations

import argparse
import json

from llmopt import LLM, SamplingParams

PASSAGE = (
    "The on-call engineer is responsible for acknowledging every page within five minutes. If the page "
    "is not acknowledged, it escalates to the secondary on-call engineer and then to the engineering "
    "manager. Every incident needs a written summary within two business days, including the timeline, "
    "the root cause, and the follow-up actions with owners and due dates."
)
CODE = (
    "def total_price(items, tax):\n    s = 0\n    for it in items:\n        s = s + it.price * it.qty\n"
    "    s = s * (1 + tax)\n    return round(s, 2)\n"
)
GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite the following paragraph, keeping every sentence but fixing nothing:\n\n{PASSAGE}",
    f"Rename the variable `s` to `subtotal` in this code and output the whole function:\n\n{CODE}",
    f"Copy this code and add a docstring to the function:\n\n{CODE}",
]
OPEN_ENDED = [
    "Write a short poem about the sea.",
    "What are three tips for staying productive when working from home?",
    "Tell me a story about a dragon who learns to cook.",
    "Explain why the sky is blue to a five-year-old.",
]


def run(llm: LLM, prompts: list[str], max_tokens: int,
        per_prompt: list[tuple[int, float]] | None = None) -> tuple[list[list[int]], float, int]:
    """Greedy chat completions one at a time; (outputs, decode seconds, decoded tokens), and each
    prompt's (decoded tokens, decode seconds) appended to `per_prompt`."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tokens: list[list[int]] = []
    decode_time = 0.0
    n_tokens = 0
    for p in prompts:  # single stream: one request at a time
        out = llm.chat([{"role": "user", "content": p}], params)[0]
        m = out.metrics
        ids = out.outputs[0].token_ids
        tokens.append(ids)
        if len(ids) > 1:
            decode_time += m.finished_time - m.first_token_time
            n_tokens += len(ids) - 1
            if per_prompt is not None:
                per_prompt.append((len(ids) - 1, m.finished_time - m.first_token_time))
    return tokens, decode_time, n_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-k", type=int, default=None, help="adapt each request's k between 1 and this")
    ap.add_argument("--method", default="ngram", choices=["ngram", "layer_skip", "draft"])
    ap.add_argument("--draft-layers", type=int, default=None, help="layer_skip: layers in the self-draft")
    ap.add_argument("--draft-model", default=None, help="draft: the draft model (same tokenizer)")
    ap.add_argument("--draft-dtype", default="auto", help="draft: its dtype (a W4A16 checkpoint computes in bf16)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    plain = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)
    spec_cfg = {"method": args.method, "num_speculative_tokens": args.k, "max_speculative_tokens": args.max_k}
    if args.draft_layers:
        spec_cfg["draft_layers"] = args.draft_layers
    if args.draft_model:
        spec_cfg.update(draft_model=args.draft_model, draft_dtype=args.draft_dtype)
    spec = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, speculative=spec_cfg)
    results = {"model": args.model, "dtype": args.dtype, "method": args.method, "k": args.k, "max_k": args.max_k,
               "draft_layers": args.draft_layers, "draft_model": args.draft_model, "max_tokens": args.max_tokens}
    for name, prompts in (("grounded", GROUNDED), ("open_ended", OPEN_ENDED)):
        run(plain, prompts[:1], 8)  # warm-up
        run(spec, prompts[:1], 8)
        c0 = spec.engine.spec_counters
        before = (c0.num_drafts, c0.num_draft_tokens, c0.num_accepted_tokens)
        pp_ref: list[tuple[int, float]] = []
        pp_spec: list[tuple[int, float]] = []
        t_ref, dt_ref, n_ref = run(plain, prompts, args.max_tokens, pp_ref)
        t_spec, dt_spec, n_spec = run(spec, prompts, args.max_tokens, pp_spec)
        c = spec.engine.spec_counters
        drafts, draft_toks, acc = (c.num_drafts - before[0], c.num_draft_tokens - before[1],
                                   c.num_accepted_tokens - before[2])
        results[name] = {
            "identical": t_ref == t_spec,
            "plain_decode_tok_s": n_ref / dt_ref,
            "spec_decode_tok_s": n_spec / dt_spec,
            "speedup": (n_spec / dt_spec) / (n_ref / dt_ref),
            "acceptance_rate": acc / draft_toks if draft_toks else 0.0,
            "mean_acceptance_length": 1 + acc / drafts if drafts else 0.0,
            "draft_tokens": draft_toks,
            "output_tokens": n_spec,
            # zip without strict: a prompt that ends after one token has no decode time on one side
            "per_prompt_speedup": [round((ns / ds) / (nr / dr), 2)
                                   for (nr, dr), (ns, ds) in zip(pp_ref, pp_spec, strict=False)],
        }
        print(name, json.dumps(results[name]), flush=True)
    results["accepted_per_position"] = spec.engine.spec_counters.accepted_per_pos
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
