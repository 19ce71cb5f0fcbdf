"""Every scheme × format: quantize the tiny model, save, load it back in llmopt, generate — and the
weights llmopt loads are exactly the ones that were quantized."""

from __future__ import annotations

import json

import pytest
import torch
from _pipeline_helpers import calib_options, quantize_tiny

from llmopt import LLM, SamplingParams
from llmopt.layers.packed_linear import vnni_kernel
from llmopt.loading.formats import read_quantized_weights
from llmopt.models.resolve import resolve_model
from llmopt.quant.rows import slice_rows

CASES = [
    # scheme, format, extra options
    ("w8a16", "gptq", {}),
    ("w8a16", "compressed-tensors", {}),
    ("w8a16", "compressed-tensors", {"symmetric": False}),
    ("w4a16", "gptq", {"group_size": 32}),
    ("w4a16", "gptq", {"group_size": 32, "symmetric": False}),
    ("w4a16", "compressed-tensors", {}),  # default group size: 128 does not divide 64 -> 64
    ("w4a16", "compressed-tensors", {"group_size": 32, "symmetric": False}),
    ("fp8", "compressed-tensors", {}),
    ("w8a8", "compressed-tensors", calib_options()),
]


def _ids(case) -> str:
    scheme, fmt, extra = case
    return f"{scheme}-{fmt}-" + ("asym" if extra.get("symmetric") is False else "sym")


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_quantize_save_load_generate(tiny_llama, tmp_path, monkeypatch, case):
    scheme, fmt, extra = case
    out = tmp_path / "q"
    report, modules = quantize_tiny(monkeypatch, tiny_llama, out, scheme=scheme, format=fmt, **extra)
    assert (out / "quantization_report.json").is_file() and (out / "tokenizer.json").is_file()
    assert report.bytes_after < report.bytes_before
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == fmt
    assert cfg["torch_dtype"] == "bfloat16"
    # 1) the checkpoint holds exactly the QuantizedWeights the algorithm produced
    stored = read_quantized_weights(resolve_model(str(out)))
    assert len(stored) == sum(len(qm.target.parts) for qm in modules.values())
    for qm in modules.values():
        for hf, (lo, hi) in qm.target.parts.items():
            want, got = slice_rows(qm.qw, lo, hi), stored[hf]
            assert torch.equal(got.q, want.q) and torch.equal(got.g_idx, want.g_idx)
            assert torch.equal(got.scale, want.scale)
            assert (got.zero is None) == (want.zero is None)
            if want.zero is not None:
                assert torch.equal(got.zero, want.zero)
    # 2) float32 on CPU applies exactly those weights (dequantized once: see quant/dequantized.py)
    llm = LLM(str(out), dtype="float32", device="cpu", num_kv_blocks=16)
    for name, qm in modules.items():
        mod = llm.engine.model.get_submodule(name)
        assert not isinstance(mod, torch.nn.Linear), f"{name} was loaded as a dense Linear"
        torch.testing.assert_close(mod.dequantize(), qm.qw.dequantize(), atol=0, rtol=0)
    # 3) bf16 (the default) runs the low-bit kernels on them, up to bf16 scale rounding
    llm = LLM(str(out), device="cpu", num_kv_blocks=16)
    # per-channel symmetric int8 is repacked into VNNI pairs where that kernel runs; a zero point is not
    w8 = "PackedInt8Linear" if vnni_kernel() is not None and extra.get("symmetric", True) else "Int8WeightOnlyLinear"
    expected = {"w8a16": w8, "w4a16": "Int4WeightOnlyLinear", "fp8": "Fp8WeightOnlyLinear",
                "w8a8": "Int8DynamicActivationLinear"}[scheme]
    for name, qm in modules.items():
        mod = llm.engine.model.get_submodule(name)
        assert type(mod).__name__ == expected and mod.compute_dtype == torch.bfloat16
        torch.testing.assert_close(mod.dequantize().float(), qm.qw.dequantize(), atol=2e-3, rtol=1e-2)
    # 4) and generates
    o = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(o[0].outputs[0].token_ids) == 4


def test_default_dtype_of_a_quantized_checkpoint_is_bf16(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "q"
    quantize_tiny(monkeypatch, tiny_llama, out, scheme="w4a16", group_size=32)
    llm = LLM(str(out), device="cpu", num_kv_blocks=16)
    assert llm.engine.dtype == torch.bfloat16
    qkv = llm.engine.model.layers[0].self_attn.qkv_proj
    assert qkv.mode in ("cpu-vnni-int4", "cpu-int4pack") and qkv.compute_dtype == torch.bfloat16
    # the float32 tensors outside the layers are stored in bf16, what they run in: a float32 load reads the
    # source rounded to bf16, and with float_dtype="source" the source bit for bit; the norms inside the layers
    # are float32 either way
    ref = LLM(str(tiny_llama), dtype="float32", device="cpu", num_kv_blocks=16).engine.model
    got = LLM(str(out), dtype="float32", device="cpu", num_kv_blocks=16).engine.model
    assert torch.equal(got.embed_tokens.weight, ref.embed_tokens.weight.bfloat16().float())
    assert torch.equal(got.layers[1].post_attention_layernorm.weight, ref.layers[1].post_attention_layernorm.weight)
    quantize_tiny(monkeypatch, tiny_llama, out, scheme="w4a16", group_size=32, float_dtype="source", overwrite=True)
    got = LLM(str(out), dtype="float32", device="cpu", num_kv_blocks=16).engine.model
    assert torch.equal(got.embed_tokens.weight, ref.embed_tokens.weight)


def test_qwen2_bias_and_act_order_roundtrip(tiny_qwen2, tmp_path, monkeypatch):
    out = tmp_path / "q"
    _, modules = quantize_tiny(monkeypatch, tiny_qwen2, out, scheme="w4a16", group_size=32, method="gptq",
                               act_order=True, format="gptq", **calib_options())
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["desc_act"] is False and cfg["static_groups"] is True  # identity g_idx: plain groups
    llm = LLM(str(out), dtype="float32", device="cpu", num_kv_blocks=16)
    qkv = llm.engine.model.layers[0].self_attn.qkv_proj
    assert qkv.bias is not None
    torch.testing.assert_close(qkv.bias, modules["layers.0.self_attn.qkv_proj"].bias)
    torch.testing.assert_close(qkv.dequantize(), modules["layers.0.self_attn.qkv_proj"].qw.dequantize())
    o = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(o[0].outputs[0].token_ids) == 3
