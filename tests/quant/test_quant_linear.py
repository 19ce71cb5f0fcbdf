from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _qhelpers import correlated_inputs, rel_err

from llmopt.errors import LlmoptError
from llmopt.layers.packed_linear import vnni_kernel
from llmopt.quant import (
    Fp8WeightOnlyLinear,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    QuantScheme,
    fp8_quantize,
    gptq_quantize,
    quantized_linear,
    rtn_quantize,
)
from llmopt.quant import linear as linear_mod

BF16_TOL = 1.5e-2  # relative L2: bf16 activations, bf16 kernel scales, fp32 accumulation


def _reference(x: torch.Tensor, qw, bias: torch.Tensor | None) -> torch.Tensor:
    b = None if bias is None else bias.bfloat16()
    return F.linear(x.bfloat16(), qw.dequantize().bfloat16(), b)


# symmetric int4 with even groups runs our VNNI kernel where this CPU has AVX512-BF16, else tinygemm's
VNNI = "cpu-vnni-int4" if vnni_kernel() is not None else None

INT4_CASES = [
    # (out, in, scheme, expected mode)
    (64, 128, QuantScheme(bits=4, group_size=32), VNNI or "cpu-int4pack"),
    (40, 128, QuantScheme(bits=4, group_size=64, symmetric=False), "cpu-int4pack"),  # N padded to 48
    (32, 192, QuantScheme(bits=4, group_size=-1), VNNI or "cpu-int4pack"),  # per-channel: one group of 192
    (32, 128, QuantScheme(bits=4, group_size=128, symmetric=False), "cpu-int4pack"),
    (32, 96, QuantScheme(bits=4, group_size=96), VNNI or "cpu-int4pack"),  # 96 = 3 kernel groups of 32
    (24, 64, QuantScheme(bits=4, group_size=16), VNNI or "dequant"),  # tinygemm's groups are >= 32
]


@pytest.mark.parametrize(
    "out_f, in_f, scheme, mode", INT4_CASES, ids=lambda v: getattr(v, "describe", lambda: v)()
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_linear_matches_dequant_reference(out_f, in_f, scheme, mode, with_bias):
    w = torch.randn(out_f, in_f) * 0.05
    bias = torch.randn(out_f) if with_bias else None
    qw = rtn_quantize(w, scheme)
    m = Int4WeightOnlyLinear.from_quantized(qw, bias)
    assert m.mode == mode and m.in_features == in_f and m.out_features == out_f
    x = torch.randn(2, 5, in_f)
    y = m(x)
    assert y.shape == (2, 5, out_f) and y.dtype == torch.float32
    assert rel_err(y, _reference(x, qw, bias)) < BF16_TOL
    assert rel_err(m.dequantize(), qw.dequantize()) < 5e-3
    # packed: ~half a byte per weight, far below a bf16 copy
    dense_bf16 = out_f * in_f * 2
    assert m.weight_nbytes() <= out_f * in_f // 2 + 16 * in_f // 2 + 4 * out_f * in_f // 32 * 2 + 4 * in_f
    if mode == "cpu-vnni-int4":  # exactly: nibbles of N rounded to 16 rows, and a bf16 scale a group and row
        n16 = -(-out_f // 16) * 16
        assert m.weight_nbytes() == n16 * in_f // 2 + in_f // m.kernel_group_size * n16 * 2
    else:
        assert m.weight_nbytes() < dense_bf16 / 2.5


def test_int4_act_order_permutes_inputs_once():
    x_cal = correlated_inputs(256, 128) * torch.linspace(0.1, 3, 128)
    w = torch.randn(64, 128) * 0.05
    qw, _ = gptq_quantize(w, 2 * x_cal.t() @ x_cal / 256, QuantScheme(bits=4, group_size=32), act_order=True,
                          static_groups=False)
    assert qw.is_act_order
    m = Int4WeightOnlyLinear.from_quantized(qw)
    assert m.mode == (VNNI or "cpu-int4pack") and m.perm is not None
    x = torch.randn(7, 128)
    assert rel_err(m(x), _reference(x, qw, None)) < BF16_TOL
    assert rel_err(m.dequantize(), qw.dequantize()) < 5e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_output_dtype_follows_input(dtype):
    qw = rtn_quantize(torch.randn(32, 64), QuantScheme(bits=4, group_size=32))
    m = quantized_linear(qw)
    x = torch.randn(3, 64).to(dtype)
    y = m(x)
    assert y.dtype == dtype
    assert rel_err(y, _reference(x, qw, None)) < BF16_TOL


def test_fp32_compute_dtype_is_near_exact():
    qw = rtn_quantize(torch.randn(32, 128), QuantScheme(bits=4, group_size=64, symmetric=False))
    m = Int4WeightOnlyLinear.from_quantized(qw, compute_dtype=torch.float32)
    x = torch.randn(4, 128)
    assert rel_err(m(x), F.linear(x, qw.dequantize())) < 1e-5


INT8_CASES = [
    (64, 128, QuantScheme(bits=8, group_size=-1), "cpu-int8"),
    (40, 96, QuantScheme(bits=8, group_size=-1, symmetric=False), "cpu-int8"),
    (32, 128, QuantScheme(bits=8, group_size=64), "dequant"),  # grouped int8: no kernel
    (32, 100, QuantScheme(bits=8, group_size=-1), "dequant"),  # bf16 kernel needs K % 16 == 0
]


@pytest.mark.parametrize(
    "out_f, in_f, scheme, mode", INT8_CASES, ids=lambda v: getattr(v, "describe", lambda: v)()
)
def test_int8_linear_matches_dequant_reference(out_f, in_f, scheme, mode):
    w = torch.randn(out_f, in_f) * 0.05
    w[0] += 0.1
    bias = torch.randn(out_f)
    qw = rtn_quantize(w, scheme)
    m = Int8WeightOnlyLinear.from_quantized(qw, bias)
    assert m.mode == mode
    x = torch.randn(3, 4, in_f)
    y = m(x)
    assert y.shape == (3, 4, out_f)
    assert rel_err(y, _reference(x, qw, bias)) < BF16_TOL
    assert rel_err(m.dequantize(), qw.dequantize()) < 5e-3
    assert m.weight_nbytes() <= out_f * in_f + 12 * out_f * qw.n_groups + 4 * in_f
    assert m.weight_nbytes() < out_f * in_f * 2 * 0.75


def test_int8_act_order_uses_fallback_with_g_idx():
    x_cal = correlated_inputs(256, 64) * torch.linspace(0.1, 3, 64)
    qw, _ = gptq_quantize(
        torch.randn(16, 64), 2 * x_cal.t() @ x_cal / 256, QuantScheme(bits=8, group_size=32), act_order=True,
        static_groups=False,
    )
    m = quantized_linear(qw)
    assert isinstance(m, Int8WeightOnlyLinear) and m.mode == "dequant"
    x = torch.randn(5, 64)
    assert rel_err(m(x), _reference(x, qw, None)) < BF16_TOL


def test_fp8_linear_emulated_and_scaled_mm(monkeypatch):
    w = torch.randn(64, 128) * 0.03
    bias = torch.randn(64)
    qw = fp8_quantize(w)
    assert rel_err(qw.dequantize(), w) < 0.05
    m = Fp8WeightOnlyLinear.from_quantized(qw, bias)
    assert m.mode == "dequant"
    x = torch.randn(2, 3, 128)
    assert rel_err(m(x), _reference(x, qw, bias)) < BF16_TOL
    assert m.weight_nbytes() == 64 * 128 + 64 * 4
    monkeypatch.setattr(linear_mod, "_FP8_DECODE_ELEMS", 128 * 10)  # decode 10 rows per slab
    assert rel_err(m(x), _reference(x, qw, bias)) < BF16_TOL
    mm = Fp8WeightOnlyLinear.from_quantized(qw, bias, activation_fp8=True)
    assert mm.mode == "scaled_mm"
    # activations are fp8 too: a few percent of error, not bf16-level
    assert rel_err(mm(x), _reference(x, qw, bias)) < 0.06


def test_wrong_inputs_are_user_errors():
    qw = rtn_quantize(torch.randn(16, 64), QuantScheme(bits=4, group_size=32))
    m = quantized_linear(qw)
    with pytest.raises(LlmoptError):
        m(torch.randn(2, 32))
    with pytest.raises(LlmoptError):
        Int8WeightOnlyLinear.from_quantized(qw)
    with pytest.raises(LlmoptError):
        Int4WeightOnlyLinear.from_quantized(qw, bias=torch.randn(3))
