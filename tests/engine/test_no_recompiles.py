"""No recompiles while batch sizes vary: a bf16 workload of varied prompt lengths, chunked prefills over cached
prefixes, prefix-cache hits and decode batches that shrink, with dynamo's recompiles made fatal. Prefill
steps run TorchInductor-compiled functions (traced once, dynamic shapes) but where a native one is faster
(`kernels.native_below`: the norms and SiLU·up only from `kernels.NATIVE_PREFILL_ROWS` rows, so the budget passes
that); decode steps run the native step, which compiles nothing."""

from __future__ import annotations

import pytest
import torch

from llmopt import LLM, SamplingParams
from llmopt.layers import kernels
from tests.models.families import tiny_gemma3, tiny_qwen2_moe  # noqa: F401


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_gemma3", "tiny_qwen2_moe"])
def test_varied_workload_never_recompiles(family, request, monkeypatch):
    model_dir = request.getfixturevalue(family)
    torch._dynamo.reset()
    monkeypatch.setattr(kernels, "_compiled", {})
    monkeypatch.setattr(kernels, "_broken", [])
    # a step budget past the rows under which the native element-wise functions run instead of inductor's, yet
    # short of the longest prompts: those are prefilled in chunks, each over the chunks before it
    budget = kernels.NATIVE_PREFILL_ROWS + 160
    llm = LLM(str(model_dir), dtype="bfloat16", device="cpu", num_kv_blocks=1024, max_num_batched_tokens=budget)
    prompts = [[3 + (7 * i + j) % 400 for j in range(3 + (i * 197) % 950)] for i in range(16)]
    assert max(map(len, prompts)) > budget
    params = [SamplingParams(temperature=0, max_tokens=4 + i % 20, ignore_eos=True) for i in range(16)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        llm.generate(prompts, params, use_tqdm=False)
        llm.generate([p + [5, 6] for p in prompts[:6]], params[:6], use_tqdm=False)  # prefix-cache hits
    # kernels.call turns a compile error (RecompileError included) into eager mode for the process
    assert kernels._broken == [], kernels._broken
    assert kernels._compiled, "no prefill step ran the compiled functions"
