"""The W8A8 runtime linear and SmoothQuant scales."""

from __future__ import annotations

import pytest
import torch
from _qhelpers import correlated_inputs, rel_err

from llmopt.errors import LlmoptError
from llmopt.quant import QuantScheme, rtn_quantize
from llmopt.quant.dynamic_int8 import Int8DynamicActivationLinear, quantize_per_token
from llmopt.quant.export import INT8_TOKEN_ACTIVATIONS
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


def _ct_token_quantize(x3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors' own dynamic per-token int8: (codes, scales, fake-quantized x) for x [B, T, K]."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize, quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = QuantizationArgs.model_validate(INT8_TOKEN_ACTIVATIONS)
    scale, zp = compute_dynamic_scales_and_zp(x3, args, module=None)
    return quantize(x3, scale, zp, args, dtype=torch.int8), scale, fake_quantize(x3, scale, zp, args)


def test_per_token_quantization_is_bit_exact_with_compressed_tensors():
    """Same codes and scales as the library that defines the checkpoint format, on activations with
    outlier channels, outlier tokens, an all-zero token, exact ±absmax values and half-step ties."""
    pytest.importorskip("compressed_tensors")
    x = correlated_inputs(96, 256, outliers=4).reshape(3, 32, 256)
    x[0, 3] = 0.0  # a padding-like token: zero scale → eps, codes 0
    x[1, 5, 7] = -50.0  # negative absmax: → −128
    x[2, 9, 11] = 50.0  # positive absmax: 127.5 → clamped to 127
    x[1, 6] = torch.arange(256) - 127.5  # absmax 127.5: scale exactly 1, every value a half-step tie
    x[2, 1] *= 1e4  # an outlier token
    codes, scales, fake = _ct_token_quantize(x)
    ours, our_scales = quantize_per_token(x.reshape(-1, 256))
    assert torch.equal(our_scales.reshape(3, 32, 1), scales)
    assert torch.equal(ours.reshape(3, 32, 256), codes)
    torch.testing.assert_close((ours.float() * our_scales).reshape(3, 32, 256), fake, rtol=0, atol=0)
    assert int(ours.min()) == -128 and int(ours.max()) == 127
    assert not ours[3].any()  # the zero token
    ties = ours.reshape(3, 32, 256)[1, 6]
    assert ties[:4].tolist() == [-128, -126, -126, -124]  # half to even, like torch.round


def test_per_token_formula_is_absmax_over_127_5():
    x = torch.tensor([[-2.55, 1.0, 0.0], [1.0, 0.5, -0.25]])
    q, s = quantize_per_token(x)
    torch.testing.assert_close(s[:, 0], torch.tensor([2.55 / 127.5, 1.0 / 127.5]))
    assert q.tolist() == [[-128, 50, 0], [127, 64, -32]]
