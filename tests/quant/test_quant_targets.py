"""Recipe validation and the target plan: presets, default group sizes, --ignore / --override over
HF names, the fused-parts rule and the one-line group-size error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from llmopt.errors import LlmoptError
from llmopt.loading.load import load_model
from llmopt.models.llama import LlamaForCausalLM
from llmopt.models.resolve import resolve_model
from llmopt.models.spec import ModelSpec
from llmopt.quant.recipe import QuantizeConfig, make_scheme
from llmopt.quant.targets import plan_targets


def _cfg(**kw) -> QuantizeConfig:
    return QuantizeConfig(output=Path("/nonexistent/out"), **kw)


def _smollm2_like() -> LlamaForCausalLM:
    spec = ModelSpec(model_type="llama", num_layers=1, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                     intermediate_size=1536, vocab_size=64, tie_word_embeddings=True)
    with torch.device("meta"):
        return LlamaForCausalLM(spec, device="meta")


def test_presets():
    assert make_scheme("w8a16", None, True).weights.describe() == "int8 channel sym"
    assert make_scheme("w4a16", None, False).weights.describe() == "int4 g128 asym"
    assert make_scheme("fp8", None, True).weights.kind == "fp8"
    w8a8 = make_scheme("w8a8", None, True)
    assert w8a8.int8_activations and w8a8.weights.per_channel


@pytest.mark.parametrize("kw, msg", [
    ({"scheme": "w5"}, "scheme"),
    ({"scheme": "fp8", "method": "gptq"}, "fp8"),
    ({"scheme": "w8a8", "method": "awq"}, "SmoothQuant"),
    ({"scheme": "w8a8", "symmetric": False}, "symmetric"),
    ({"scheme": "w4a16", "act_order": True}, "act-order"),
    ({"scheme": "fp8", "format": "gptq"}, "gptq format"),
    ({"scheme": "w4a16", "ignore": ["("]}, "bad regex"),
    ({"scheme": "w4a16", "override": ["mlp=w3"]}, "unknown scheme"),
    ({"scheme": "w4a16", "override": ["mlp"]}, "REGEX=SCHEME"),
    ({"scheme": "w4a16", "calib": "x", "calib_data": ["y"]}, "either"),
])
def test_bad_recipes_are_rejected(kw, msg):
    with pytest.raises(ValidationError, match=msg):
        _cfg(**kw)


def test_act_order_is_on_by_default_for_gptq_only():
    """Issue #32: GPTQ without act-order lost to RTN on SmolLM2, so act-order (static groups) is the default."""
    assert _cfg(scheme="w4a16", method="gptq").act_order is True
    assert _cfg(scheme="w4a16", method="gptq", act_order=False).act_order is False
    assert _cfg(scheme="w4a16").act_order is False and _cfg(scheme="w4a16", method="awq").act_order is False
    assert _cfg(scheme="w4a16", act_order=False).act_order is False  # --no-act-order is harmless with rtn
    with pytest.raises(ValidationError, match="needs --format gptq"):  # the default act-order, dynamic groups
        _cfg(scheme="w4a16", method="gptq", static_groups=False)


def test_w4_default_group_falls_back_with_a_note_and_explicit_128_fails():
    model = _smollm2_like()
    targets, notes = plan_targets(model, _cfg(scheme="w4a16"))
    assert {t.scheme.weights.group_size for t in targets if t.scheme} == {64}
    assert "using 64" in notes[0]
    with pytest.raises(LlmoptError) as e:
        plan_targets(model, _cfg(scheme="w4a16", group_size=128))
    msg = str(e.value)
    assert "valid group sizes: 8, 16, 24, 32, 48, 64, 96, 192 (multiples of 32 for the int4 kernels: 32, 64, 96, 192)" \
        in msg and "or -1 (per channel)" in msg and "\n" not in msg


def test_ignore_override_and_fused_rule(tiny_llama):
    model = load_model(resolve_model(str(tiny_llama)), torch.float32)
    targets, _ = plan_targets(model, _cfg(scheme="w4a16", group_size=32, ignore=[r"layers\.1\.mlp"],
                                          override=[r"self_attn\.o_proj=w8a16"]))
    by = {t.module: t for t in targets}
    assert by["lm_head"].scheme is None
    assert by["layers.1.mlp.gate_up_proj"].scheme is None and by["layers.1.mlp.down_proj"].scheme is None
    assert by["layers.0.self_attn.o_proj"].scheme.preset == "w8a16"
    assert by["layers.0.self_attn.o_proj"].scheme.weights.group_size == -1  # the preset's own default
    assert list(by["layers.0.self_attn.qkv_proj"].parts) == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    with pytest.raises(LlmoptError, match="one fused weight"):
        plan_targets(model, _cfg(scheme="w4a16", group_size=32, ignore=["v_proj"]))
    with pytest.raises(LlmoptError, match="lm_head is not supported"):
        plan_targets(model, _cfg(scheme="w4a16", group_size=32, override=["lm_head=w8a16"]))
    with pytest.raises(LlmoptError, match="no linear is left"):
        plan_targets(model, _cfg(scheme="w4a16", group_size=32, ignore=["proj"]))
