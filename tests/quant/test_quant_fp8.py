from __future__ import annotations

import pytest
import torch

from llmopt.errors import LlmoptError
from llmopt.quant import FP8_E4M3_MAX, QuantScheme, fp8_dequantize, fp8_quantize


def test_fp8_per_channel_scale_and_error():
    w = torch.randn(16, 64) * torch.logspace(-3, 1, 16)[:, None]
    w[5] = 0
    qw = fp8_quantize(w)
    assert qw.q.dtype == torch.float8_e4m3fn and qw.scale.shape == (16, 1)
    absmax = w.abs().amax(1, keepdim=True)
    live = absmax[:, 0] > 0
    assert torch.allclose(qw.scale[live], absmax[live] / FP8_E4M3_MAX)
    assert float(qw.q.float().abs().max()) <= FP8_E4M3_MAX
    deq = qw.dequantize()
    assert torch.equal(deq[5], torch.zeros(64))
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values
    big = w.abs() > absmax * 2**-6
    assert bool(((deq - w).abs()[big] <= w.abs()[big] * 2**-4 + 1e-12).all())
    assert torch.equal(fp8_dequantize(qw.q, qw.scale[:, 0]), deq)


def test_fp8_rejects_int_scheme():
    with pytest.raises(LlmoptError):
        fp8_quantize(torch.randn(4, 8), QuantScheme(bits=8, group_size=-1))
