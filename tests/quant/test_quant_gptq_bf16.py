"""GPTQ Hessians from bf16 products (what the sequential pass uses on CPU) match fp32 ones closely
enough that GPTQ's result is as good."""

from __future__ import annotations

import torch
from _qhelpers import correlated_inputs, out_err

from llmopt.quant import GPTQ, QuantScheme, gptq_quantize


def test_bf16_products_give_the_same_hessian_and_quality():
    x = correlated_inputs(2048, 128).bfloat16()
    h32, h16 = GPTQ(128), GPTQ(128, product_dtype=torch.bfloat16)
    for chunk in x.split(256):
        h32.add_batch(chunk)
        h16.add_batch(chunk)
    assert float((h16.H - h32.H).norm() / h32.H.norm()) < 5e-3
    w = torch.randn(64, 128) * 0.05
    scheme = QuantScheme(bits=4, group_size=32)
    q32, _ = gptq_quantize(w, h32.H, scheme)
    q16, _ = gptq_quantize(w, h16.H, scheme)
    xf = x.float()
    assert out_err(xf, w, q16.dequantize()) < 1.02 * out_err(xf, w, q32.dequantize())
