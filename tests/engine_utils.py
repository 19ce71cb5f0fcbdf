"""Shared helpers for engine tests: the token ids an LLM generates, and a reference greedy decode
through transformers."""

from __future__ import annotations

import torch


def hf_greedy(model_dir, prompts_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation by transformers' generate, never stopping early (no EOS handling)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    outs = []
    with torch.no_grad():
        for ids in prompts_ids:
            x = torch.tensor([ids])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                            do_sample=False)
            outs.append(y[0, len(ids):].tolist())
    return outs


def token_ids(llm, prompts, params) -> list[list[int]]:
    """The token ids of each prompt's first completion from `llm.generate(prompts, params)`."""
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
