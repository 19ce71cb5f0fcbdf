"""Gemma 3 through quantization: RTN and GPTQ at W4A16 and W8A16, both export formats, loaded back by
llmopt (exactly the quantized weights, the (1 + w) norms untouched) and, for compressed-tensors, by
transformers (the same dequantized weights, the same logits). AWQ / SmoothQuant scale folding goes into
the norms the model class names (pre_feedforward_layernorm feeds the MLP), through the 1 + w offset."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from llmopt import LLM, SamplingParams
from llmopt.engine.scoring import iter_logits
from llmopt.layers.linear import output_splits
from llmopt.quant.awq import fold_scales_into_linear_rows, fold_scales_into_norm, scale_linear_inputs
from tests.models.families import tiny_gemma3  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
from _pipeline_helpers import assert_transformers_loads_export, calib_options, quantize_tiny  # noqa: E402

SEQS = [list(range(3, 200, 7)), [5, 9, 17, 33]]
CASES = [(m, s, f) for m in ("rtn", "gptq") for s in ("w4a16", "w8a16") for f in ("compressed-tensors", "gptq")]


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_gemma3_quantize_export_load_generate(tiny_gemma3, tmp_path, monkeypatch, case):  # noqa: F811
    method, scheme, fmt = case
    out = tmp_path / "q"
    extra = calib_options() if method == "gptq" else {}
    group = {"group_size": 32} if scheme == "w4a16" else {}
    _, modules = quantize_tiny(monkeypatch, tiny_gemma3, out, scheme=scheme, method=method, format=fmt,
                               **group, **extra)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == fmt
    assert {qm.method for qm in modules.values()} == {method}
    llm = LLM(str(out), dtype="float32", device="cpu", num_kv_blocks=32)
    model = llm.engine.model
    for name, qm in modules.items():
        torch.testing.assert_close(model.get_submodule(name).dequantize(), qm.qw.dequantize(), atol=0, rtol=0)
    src = LLM(str(tiny_gemma3), dtype="float32", device="cpu", num_kv_blocks=8).engine.model
    for norm in ("post_feedforward_layernorm", "self_attn.k_norm"):
        assert torch.equal(model.layers[1].get_submodule(norm).weight, src.layers[1].get_submodule(norm).weight)
    o = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(o[0].outputs[0].token_ids) == 4
    if fmt == "compressed-tensors":
        assert_transformers_loads_export(out, llm, modules)


def test_scale_folding_into_the_declared_producers_keeps_the_function(tiny_gemma3):  # noqa: F811
    """W·diag(s) with 1/s folded into each producer `quant_producers` names leaves the logits unchanged; a
    wrong producer (post_attention_layernorm for the MLP) or a fold without the 1 + w offset would not."""
    llm = LLM(str(tiny_gemma3), dtype="float32", device="cpu", num_kv_blocks=32)
    model = llm.engine.model
    before = dict(iter_logits(llm.engine, SEQS))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.layers:
            for rel, (producer, part) in type(model).quant_producers.items():
                lin, prod = layer.get_submodule(rel), layer.get_submodule(producer)
                s = 0.5 + torch.rand(lin.in_features, generator=g)
                lin.weight.copy_(scale_linear_inputs(lin.weight, s))
                if part is None:
                    prod.weight.copy_(fold_scales_into_norm(prod.weight, s, prod.weight_offset))
                else:
                    lo, hi = output_splits(prod)[part]
                    prod.weight[lo:hi] = fold_scales_into_linear_rows(prod.weight[lo:hi], s)
    after = dict(iter_logits(llm.engine, SEQS))
    for i in before:
        torch.testing.assert_close(after[i], before[i], atol=1e-4, rtol=1e-4)
        assert not torch.equal(after[i], before[i])  # the weights did change


@pytest.mark.parametrize("method, scheme, max_mse", [("awq", "w4a16", 0.1), ("rtn", "w8a8", 2e-3)])
def test_awq_and_smoothquant_fold_into_gemma3_norms(tiny_gemma3, tmp_path, monkeypatch, method, scheme,  # noqa: F811
                                                     max_mse):
    """The calibrated transforms (AWQ scales; SmoothQuant for w8a8) fold into input_layernorm and
    pre_feedforward_layernorm (post_attention_layernorm feeds no linear and stays as it was), and the
    result stays close to the float model. Measured logit MSE (fp32 logits of magnitude ~2): AWQ W4 g32
    0.033-0.042 (RTN 0.033-0.043), W8A8 SmoothQuant 0.0003; a fold that missed the 1 + w offset or
    the right norm changes the function itself (see the test above)."""
    out = tmp_path / "q"
    group = {"group_size": 32} if scheme == "w4a16" else {}
    quantize_tiny(monkeypatch, tiny_gemma3, out, scheme=scheme, method=method, format="compressed-tensors",
                  **group, **calib_options())
    qllm = LLM(str(out), dtype="float32", num_kv_blocks=32)
    fllm = LLM(str(tiny_gemma3), dtype="float32", num_kv_blocks=32)
    for layer_q, layer_f in zip(qllm.engine.model.layers, fllm.engine.model.layers, strict=True):
        for norm in ("input_layernorm", "pre_feedforward_layernorm"):
            assert not torch.equal(layer_q.get_submodule(norm).weight, layer_f.get_submodule(norm).weight)
        assert torch.equal(layer_q.post_attention_layernorm.weight, layer_f.post_attention_layernorm.weight)
    q, f = dict(iter_logits(qllm.engine, SEQS)), dict(iter_logits(fllm.engine, SEQS))
    for i in f:
        assert float(((q[i] - f[i]) ** 2).mean()) < max_mse
