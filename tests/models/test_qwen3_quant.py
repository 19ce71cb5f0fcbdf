"""Qwen3 through quantization: RTN and GPTQ, both export formats, loaded back by llmopt (exactly the
quantized weights, q/k norms kept) and by transformers (the same dequantized weights, the same logits)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from llmopt import LLM, SamplingParams
from tests.models.families import tiny_qwen3  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
from _pipeline_helpers import assert_transformers_loads_export, calib_options, quantize_tiny  # noqa: E402

CASES = [
    ("rtn", "compressed-tensors", {}),
    ("rtn", "gptq", {}),
    ("gptq", "compressed-tensors", calib_options()),
    ("gptq", "gptq", {"act_order": True, **calib_options()}),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-{f}" for m, f, _ in CASES])
def test_qwen3_quantize_export_load_generate(tiny_qwen3, tmp_path, monkeypatch, case):  # noqa: F811
    method, fmt, extra = case
    out = tmp_path / "q"
    _, modules = quantize_tiny(monkeypatch, tiny_qwen3, out, scheme="w4a16", group_size=32, method=method,
                               format=fmt, **extra)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == fmt
    llm = LLM(str(out), dtype="float32", device="cpu", num_kv_blocks=16)
    model = llm.engine.model
    for name, qm in modules.items():
        torch.testing.assert_close(model.get_submodule(name).dequantize(), qm.qw.dequantize(), atol=0, rtol=0)
    src = LLM(str(tiny_qwen3), dtype="float32", device="cpu", num_kv_blocks=16).engine.model
    assert torch.equal(model.layers[1].self_attn.k_norm.weight, src.layers[1].self_attn.k_norm.weight)
    o = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(o[0].outputs[0].token_ids) == 4
    if fmt == "compressed-tensors":
        assert_transformers_loads_export(out, llm, modules)
