"""The W8A8 runtime linear and SmoothQuant scales."""

from __future__ import annotations

import pytest
import torch
from _qhelpers import correlated_inputs, rel_err

from llmopt.errors import LlmoptError
from llmopt.quant import QuantScheme, rtn_quantize
from llmopt.quant.dynamic_int8 import Int8DynamicActivationLinear, quantize_per_token
from llmopt.quant.smoothquant import smoothing_scales


def _w8(out: int = 48, inp: int = 96) -> torch.Tensor:
    return torch.randn(out, inp) * 0.05


def test_int_mm_and_emulation_agree_and_match_fake_quant_reference():
    qw = rtn_quantize(_w8(), QuantScheme(bits=8, group_size=-1))
    bias = torch.randn(48)
    m = Int8DynamicActivationLinear.from_quantized(qw, bias, compute_dtype=torch.float32)
    assert m.mode == "int_mm"
    x = torch.randn(3, 5, 96)
    y = m(x)
    xq, xs = quantize_per_token(x.reshape(-1, 96))
    ref = ((xq.float() * xs) @ qw.dequantize().t() + bias).reshape(3, 5, 48)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    m.mode = "emulated"
    torch.testing.assert_close(m(x), y)
    assert rel_err(y, x @ qw.dequantize().t() + bias) < 2e-2  # activation rounding is small
    torch.testing.assert_close(m.dequantize(), qw.dequantize())


def test_w8a8_needs_symmetric_per_channel_int8():
    with pytest.raises(LlmoptError, match="W8A8"):
        Int8DynamicActivationLinear.from_quantized(rtn_quantize(_w8(), QuantScheme(bits=8, group_size=32)))
    with pytest.raises(LlmoptError, match="W8A8"):
        Int8DynamicActivationLinear.from_quantized(rtn_quantize(_w8(), QuantScheme(bits=4, group_size=-1)))


def test_smoothing_moves_outliers_into_the_weights():
    x = correlated_inputs(512, 64, outliers=4)
    w = torch.randn(32, 64) * 0.05
    s = smoothing_scales(x.abs().amax(0), w, alpha=0.5)
    xs, ws = x / s, w * s
    torch.testing.assert_close(xs @ ws.t(), x @ w.t(), atol=1e-4, rtol=1e-4)
    ratio = lambda a: float(a.abs().amax(0).max() / a.abs().amax(0).median())  # noqa: E731
    assert ratio(xs) < ratio(x) / 3

    def w8a8_err(xa: torch.Tensor, wa: torch.Tensor) -> float:
        qw = rtn_quantize(wa, QuantScheme(bits=8, group_size=-1, scale_dtype="float32"))
        m = Int8DynamicActivationLinear.from_quantized(qw, compute_dtype=torch.float32)
        return rel_err(m(xa), x @ w.t())

    assert w8a8_err(xs, ws) < w8a8_err(x, w)
    dead = torch.zeros(64)
    assert torch.equal(smoothing_scales(dead, w), torch.ones(64))
