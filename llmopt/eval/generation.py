"""`generate_until` requests through the engine's own generation path (`LLM.generate`).

Like lm-eval's HFLM: the context is encoded with the tokenizer's defaults and left-truncated to
max_length - max_gen_toks, generation is greedy unless the task samples, stops at any `until` string
or EOS, and the generated tokens are decoded in one go and cut at the first occurrence of each stop
string (the engine already stops there; cutting again keeps the two identical when a stop string
ends inside a token). All prompts are
submitted at once, so continuous batching runs them concurrently.
"""

from __future__ import annotations

from typing import Any

from llmopt.engine.llm import LLM
from llmopt.engine.sampling_params import SamplingParams
from llmopt.eval.loglikelihood import tok_encode

SAMPLING_SEED = 1234


def postprocess(text: str, until: list[str]) -> str:
    """lm-eval's postprocess_generated_text: cut at the first occurrence of each stop string, in order."""
    for term in until:
        if term:
            text = text.split(term)[0]
    return text


def generate_until(llm: LLM, contexts: list[str], gen: dict[str, Any]) -> list[str]:
    """Greedy (or, with do_sample, seeded) continuations of every context, stop strings removed."""
    until: list[str] = list(gen["until"])
    max_gen = int(gen["max_gen_toks"])
    eng = llm.engine
    eos = eng.tokenizer.decode([eng.tokenizer.eos_token_id], skip_special_tokens=False) \
        if eng.tokenizer.eos_token_id is not None else None
    if eos and eos not in until:
        until.append(eos)  # lm-eval's handle_stop_sequences
    max_ctx = max(1, eng.max_model_len - max_gen)
    sample = bool(gen.get("do_sample", False)) and float(gen.get("temperature", 1.0)) > 0
    params = SamplingParams(
        temperature=float(gen.get("temperature", 1.0)) if sample else 0.0,
        top_p=float(gen.get("top_p", 1.0)) if sample else 1.0,
        top_k=int(gen.get("top_k", -1) or -1) if sample else -1,
        seed=SAMPLING_SEED if sample else None,
        max_tokens=max_gen,
        stop=[u for u in until if u],
    )
    prompts = [{"prompt": c, "prompt_token_ids": tok_encode(eng.tokenizer, c)[-max_ctx:]} for c in contexts]
    outs = llm.generate(prompts, params)
    # decode the whole continuation as HFLM does (the streaming text withholds incomplete UTF-8)
    return [postprocess(eng.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True), until)
            for o in outs]
