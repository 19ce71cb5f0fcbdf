"""Runs inside vLLM's own venv (.peers/vllm): load one checkpoint, greedy-generate and score windows.

Reads a job JSON {model, dtype, max_model_len, prompts: [[ids]], max_tokens, windows: [[ids]]} and writes
{"ok": true, "greedy": [[ids]], "nll_sum", "tokens", "vllm_version"} or {"ok": false, "error": "one line"}.
It imports nothing from llmopt, so it runs under vLLM's Python and dependencies alone.
"""

from __future__ import annotations

import json
import math
import sys
import traceback


def _error_line(exc: BaseException) -> str:
    """The innermost message: vLLM wraps loader errors in several layers of RuntimeError."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:400]


def main(job_path: str, out_path: str) -> None:
    job = json.load(open(job_path))
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
                  enforce_eager=True, **job.get("llm_args", {}))
        greedy = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]],
                              SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True))
        scored = llm.generate([TokensPrompt(prompt_token_ids=w) for w in job["windows"]],
                              SamplingParams(max_tokens=1, prompt_logprobs=0))
        nll, tokens = 0.0, 0
        for window, out in zip(job["windows"], scored, strict=True):
            for tok, lp in zip(window[1:], out.prompt_logprobs[1:], strict=True):
                nll -= lp[tok].logprob
                tokens += 1
        result = {"ok": True, "vllm_version": vllm.__version__, "greedy": [list(o.outputs[0].token_ids) for o in greedy],
                  "nll_sum": nll, "tokens": tokens, "ppl": math.exp(nll / tokens)}
    except BaseException as e:  # the driver reports why a scheme does not load; any failure is a result
        traceback.print_exc()
        result = {"ok": False, "error": _error_line(e)}
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
