"""Structured outputs, measured on SmolLM2-135M on this machine.

    python benchmarks/structured_outputs.py engines       # xgrammar vs llguidance (needs `pip install xgrammar`)
    python benchmarks/structured_outputs.py throughput [--dtype float32] [--batch 8] [--max-tokens 96] [--rounds 3]

`engines` compares the two grammar engines on SmolLM2's 49k-token tokenizer: tokenizer set-up, schema
compile time cold and cached, and the per-token mask time along a random walk through each grammar
(every step picks a random allowed token, so the walk visits string, number and structural states).

`throughput` runs `--batch` concurrent requests through the engine, unconstrained (ignore_eos,
max_tokens) and constrained by a JSON schema (temperature 1 both times), alternating for `--rounds`,
and compares the median time of decode steps that hold the whole batch: their per-token cost is the step time over the batch size, so
requests of different lengths compare fairly. It also times the engine's schema compiler: the first
compile (which builds llguidance's tokenizer), a cold compile of a new schema, a cached one, and the
per-sequence matcher copy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

SCHEMAS = {
    "flat": {"type": "object", "additionalProperties": False, "required": ["name", "age", "color"],
             "properties": {"name": {"type": "string", "maxLength": 20},
                            "age": {"type": "integer", "minimum": 0, "maximum": 120},
                            "color": {"enum": ["red", "green", "blue"]}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "items", "note"],
               "properties": {
                   "user": {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
                            "properties": {"id": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                    "minItems": 1, "maxItems": 3}}},
                   "items": {"type": "array", "minItems": 1, "maxItems": 4,
                             "items": {"type": "object", "additionalProperties": False,
                                       "required": ["sku", "qty", "price"],
                                       "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                                      "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                                                      "price": {"type": "number"}}}},
                   "note": {"type": ["string", "null"], "maxLength": 30}}},
}
ORDER = {"type": "object", "additionalProperties": False, "required": ["customer", "items", "priority"],
         "properties": {
             "customer": {"type": "string", "maxLength": 24},
             "items": {"type": "array", "minItems": 3, "maxItems": 5,
                       "items": {"type": "object", "additionalProperties": False, "required": ["name", "qty"],
                                 "properties": {"name": {"type": "string", "maxLength": 16},
                                                "qty": {"type": "integer", "minimum": 1, "maximum": 99}}}},
             "priority": {"enum": ["low", "normal", "high"]}}}
PROMPTS = ["Write a grocery order for a family dinner as JSON.", "Give me an order for a hardware store as JSON.",
           "An office supplies order, as JSON please.", "Make up a bakery order in JSON.",
           "A camping trip shopping list as a JSON order.", "Order parts for a bicycle repair, in JSON.",
           "JSON order: birthday party supplies.", "Create a JSON order for a coffee shop restock."]


def _smollm2_tokenizer():
    from llmopt.models.resolve import resolve_model, weights_dir
    from llmopt.models.tokenizer import load_tokenizer

    return load_tokenizer(weights_dir(resolve_model("smollm2-135m")))


def _walk(fill, accept, done, vocab: int, steps: int = 150, seed: int = 0) -> list[float]:
    """Mask times (s) along a random walk of allowed tokens."""
    import torch

    bits = torch.arange(32, dtype=torch.int32)
    rng = random.Random(seed)
    times = []
    for _ in range(steps):
        if done():
            break
        t = time.perf_counter()
        bm = fill()
        times.append(time.perf_counter() - t)
        allowed = ((bm[0].unsqueeze(1) >> bits) & 1).reshape(-1)[:vocab].nonzero().flatten().tolist()
        assert accept(rng.choice(allowed))
    return times


def _row(engine: str, name: str, cold: float, cached: float, times: list[float]) -> dict:
    s = sorted(times)
    return {"engine": engine, "schema": name, "compile_cold_ms": round(cold * 1e3, 2),
            "compile_cached_ms": round(cached * 1e3, 3), "mask_median_ms": round(statistics.median(s) * 1e3, 3),
            "mask_p90_ms": round(s[int(0.9 * len(s))] * 1e3, 3), "mask_max_ms": round(s[-1] * 1e3, 2),
            "steps": len(s)}


def engines() -> list[dict]:
    import torch

    tok = _smollm2_tokenizer()
    vocab = 49152
    rows = []
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar is not installed (pip install xgrammar): measuring llguidance only", file=sys.stderr)
        xgr = None
    if xgr is not None:
        t = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        print(f"xgrammar tokenizer info: {(time.perf_counter() - t) * 1e3:.0f} ms")
        comp = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
        for name, schema in SCHEMAS.items():
            text = json.dumps(schema)
            t = time.perf_counter()
            cg = comp.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            cold = time.perf_counter() - t
            t = time.perf_counter()
            comp.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            cached = time.perf_counter() - t
            m = xgr.GrammarMatcher(cg)
            bm = xgr.allocate_token_bitmask(1, vocab)

            def fill(m=m, bm=bm):
                m.fill_next_token_bitmask(bm)
                return bm

            rows.append(_row("xgrammar", name, cold, cached, _walk(fill, m.accept_token, m.is_terminated, vocab)))
    import llguidance
    import llguidance.hf

    t = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok, vocab)
    print(f"llguidance tokenizer: {(time.perf_counter() - t) * 1e3:.0f} ms")
    for name, schema in SCHEMAS.items():
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        template = llguidance.LLMatcher(lt, grammar, log_level=0)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        m = template.deep_copy()  # what the engine's cache hands each sequence
        cached = time.perf_counter() - t
        bm = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)

        def fill(m=m, bm=bm):
            m.unsafe_compute_mask_ptr(bm.data_ptr(), bm.numel() * 4)
            return bm

        rows.append(_row("llguidance", name, cold, cached, _walk(fill, m.consume_token, m.is_stopped, vocab)))
    return rows


def _decode_steps(llm, prompts, params) -> tuple[list[tuple[float, float]], list, float]:
    """(step time, sample + postprocess time) of full-batch decode steps, the outputs, and the wall time."""
    steps: list[tuple[float, float]] = []
    n = len(prompts)

    def listen(s):
        if s.batch_size == n and s.num_prefill_tokens == 0:
            steps.append((s.step_time, s.sample_time + s.postprocess_time))

    llm.engine.stat_listeners.append(listen)
    try:
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t
    finally:
        llm.engine.stat_listeners.remove(listen)
    return steps, outs, wall


def throughput(dtype: str, batch: int, max_tokens: int, rounds: int) -> dict:
    import jsonschema

    from llmopt import LLM, SamplingParams
    from llmopt.engine.structured_output import StructuredOutputsParams

    os.environ.setdefault("LLMOPT_CACHE", tempfile.mkdtemp(prefix="llmopt-so-bench-"))
    llm = LLM("smollm2-135m", dtype=dtype, device="cpu", kv_cache_memory="256MiB", enable_prefix_caching=False)
    comp = llm.engine.structured_outputs
    timings = {}
    t = time.perf_counter()
    comp.compile(StructuredOutputsParams(json=SCHEMAS["flat"]))
    timings["first_compile_ms (incl. tokenizer)"] = (time.perf_counter() - t) * 1e3
    spec = StructuredOutputsParams(json=ORDER)
    t = time.perf_counter()
    comp.compile(spec)
    timings["compile_cold_ms"] = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    for _ in range(100):
        comp.compile(spec)
    timings["compile_cached_ms"] = (time.perf_counter() - t) * 10
    t = time.perf_counter()
    for _ in range(100):
        comp.matcher(spec)
    timings["matcher_copy_ms"] = (time.perf_counter() - t) * 10
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                       add_generation_prompt=True, tokenize=False) for i in range(batch)]
    prompts = [{"prompt": p, "prompt_token_ids": tok.encode(p, add_special_tokens=False)} for p in prompts]
    # warm up both paths once (first-call overheads, the grammar's lazily built lexer)
    llm.generate(prompts[:2], SamplingParams(temperature=1.0, seed=0, max_tokens=8, structured_outputs=spec))
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True) for i in range(batch)]
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens * 2, structured_outputs=spec)
                   for i in range(batch)]
    steps: dict[str, list[tuple[float, float]]] = {"unconstrained": [], "constrained": []}
    tokens = dict.fromkeys(steps, 0)
    wall = dict.fromkeys(steps, 0.0)
    valid = 0
    for _ in range(rounds):  # alternate, so that load from elsewhere on the machine hits both alike
        for name, params in (("unconstrained", plain), ("constrained", constrained)):
            st, outs, w = _decode_steps(llm, prompts, params)
            steps[name] += st
            tokens[name] += sum(len(o.outputs[0].token_ids) for o in outs)
            wall[name] += w
            if name == "constrained":
                for o in outs:
                    try:
                        jsonschema.validate(json.loads(o.outputs[0].text), ORDER)
                        valid += o.outputs[0].finish_reason == "stop"
                    except (ValueError, jsonschema.ValidationError):
                        pass
    res: dict = {}
    for name in steps:
        med = statistics.median(t for t, _ in steps[name])
        res[name] = {"full_batch_steps": len(steps[name]), "step_ms_median": med * 1e3,
                     "ms_per_token": med * 1e3 / batch,
                     "sample_and_postprocess_ms_median": statistics.median(p for _, p in steps[name]) * 1e3,
                     "tokens": tokens[name], "tokens_per_s_end_to_end": tokens[name] / wall[name]}
    res["constrained"]["valid_and_stopped"] = f"{valid}/{batch * rounds}"
    ratio = res["constrained"]["ms_per_token"] / res["unconstrained"]["ms_per_token"]
    res["constrained_cost_per_token"] = f"{(ratio - 1) * 100:+.1f}%"
    # the part that is the grammar's (masks in the sampler, advancing matchers), against a plain step: less
    # sensitive to other load on the machine than the step-time ratio
    extra = res["constrained"]["sample_and_postprocess_ms_median"] - res["unconstrained"]["sample_and_postprocess_ms_median"]
    res["grammar_ms_per_step"] = extra
    res["grammar_cost_per_token_from_components"] = f"{extra / res['unconstrained']['step_ms_median'] * 100:+.1f}%"
    return {"compiler": {k: round(v, 3) for k, v in timings.items()}, "throughput": res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("engines")
    tp = sub.add_parser("throughput")
    tp.add_argument("--dtype", default="float32")
    tp.add_argument("--batch", type=int, default=8)
    tp.add_argument("--max-tokens", type=int, default=96)
    tp.add_argument("--rounds", type=int, default=3)
    tp.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.cmd == "engines":
        rows = engines()
        cols = list(rows[0])
        print(" | ".join(cols))
        for r in rows:
            print(" | ".join(str(r[c]) for c in cols))
    else:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(throughput(args.dtype, args.batch, args.max_tokens, args.rounds), indent=2, default=str))


if __name__ == "__main__":
    main()
