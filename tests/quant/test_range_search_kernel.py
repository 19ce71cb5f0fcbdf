"""GPTQ's range search in C (`range_search.c`): its errors against torch's fake-quantize arithmetic (row tails
past 16 lanes, signed and asymmetric scales, per-element and broadcast weights, thread counts), the search's
choices against the torch search, its memory, and the torch path when the kernel cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from llmopt.quant import range_search_kernel as rk
from llmopt.quant.gptq import gptq_quantize, range_weights
from llmopt.quant.rtn import fake_quantize, mse_params, params_from_range
from llmopt.quant.scheme import QuantScheme
from tests.conftest import needs_cc


def _torch_errors(w, wt, scale, zero, maxq):
    return ((fake_quantize(w, scale[..., None], zero[..., None], maxq) - w) ** 2 * wt).sum(-1)


@needs_cc
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cols", [1, 15, 16, 32, 45, 128, 1000])
@pytest.mark.parametrize("bits, symmetric", [(4, True), (4, False), (8, True), (8, False)])
def test_errors_match_torchs_fake_quantize(cols, bits, symmetric, threads):
    """Every candidate's error is torch's to float32 summation error, for row lengths that end inside a
    16-lane vector, int4's signed scales (its extreme on the lowest code), asymmetric zeros and ranges shrunk
    to 30% (values past them clamp to the end codes); weights per element, and one row or one value for every row."""
    kernel = rk.load()
    assert kernel is not None
    g = torch.Generator().manual_seed(cols * 10 + bits)
    w = torch.randn(37, cols, generator=g) ** 3
    scheme = QuantScheme(bits=bits, group_size=-1, symmetric=symmetric, scale_dtype="float32")
    p = torch.linspace(1.0, 0.3, 6)[:, None]
    scale, zero = params_from_range(p * w.amin(1), p * w.amax(1), scheme)  # [6, 37], some scales negative
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for wt in (torch.rand(37, cols, generator=g), torch.rand(cols, generator=g), torch.tensor(0.7)):
            ours = kernel.errors(w, wt, scale, zero, scheme.maxq)
            theirs = _torch_errors(w.double(), wt.double(), scale.double(), zero.double(), scheme.maxq)
            assert ours.shape == (6, 37)
            torch.testing.assert_close(ours.double(), theirs, rtol=2e-5, atol=1e-30)
    finally:
        torch.set_num_threads(prev)


@needs_cc
@pytest.mark.parametrize("group_size, symmetric", [(32, True), (128, True), (64, False), (-1, True)])
def test_search_picks_torchs_ranges(group_size, symmetric):
    """The search on the kernel's errors picks torch's range for (nearly) every group: the scores agree to
    rounding, so only a near tie may go the other way, and then at the same weighted error."""
    g = torch.Generator().manual_seed(group_size)
    w = torch.randn(512, 256, generator=g) * 0.02
    w[:, 3] *= 30  # an outlier input, as real layers have
    hdiag = torch.rand(256, generator=g) ** 4
    wt = range_weights(w, hdiag, 2 * w.pow(2).mean(1))
    scheme = QuantScheme(bits=4 if group_size > 0 else 8, group_size=group_size, symmetric=symmetric)
    gs = group_size if group_size > 0 else 256
    rows, wts = w.reshape(-1, gs), wt.reshape(-1, gs)
    (s0, z0), (s1, z1) = (mse_params(rows, scheme, weights=wts, native=n) for n in (False, True))
    differ = (s0 != s1) | (z0 != z1)
    assert int(differ.sum()) <= max(1, rows.shape[0] // 1000)
    e0 = _torch_errors(rows.double(), wts.double(), s0[:, None].double().T, z0[:, None].double().T, scheme.maxq)
    e1 = _torch_errors(rows.double(), wts.double(), s1[:, None].double().T, z1[:, None].double().T, scheme.maxq)
    torch.testing.assert_close(e1, e0, rtol=1e-5, atol=0)


@needs_cc
def test_native_search_keeps_temporaries_small():
    """With the kernel the only temporaries are the [candidates, rows] scores and their parameters: a 16 MB
    weight's search stays under 64 MB of live tensors (torch's path holds 10 candidates x the weight at once
    without its slabs)."""
    from llmopt.testing.live_bytes import LiveTensorBytes

    w = torch.randn(32768, 128)
    weights = torch.rand(32768, 128)
    with LiveTensorBytes() as m:
        mse_params(w, QuantScheme(bits=4, group_size=128), weights=weights)
    assert m.peak < 64e6


def test_failed_build_falls_back_to_torch(no_compiler, caplog):
    """No working compiler: one warning, and the range search (and GPTQ over it) runs on torch's path."""
    g = torch.Generator().manual_seed(1)
    w, wt = torch.randn(64, 32, generator=g), torch.rand(64, 32, generator=g)
    scheme = QuantScheme(bits=4, group_size=32)
    with caplog.at_level(logging.WARNING):
        assert rk.load() is None
        fallback = mse_params(w, scheme, weights=wt)
        x = torch.randn(256, 128, generator=g)
        gptq_quantize(torch.randn(16, 128, generator=g), x.t() @ x, scheme, mse_observer=True)
    assert caplog.text.count("range search kernel unavailable") == 1
    torch_path = mse_params(w, scheme, weights=wt, native=False)
    assert all(torch.equal(a, b) for a, b in zip(fallback, torch_path, strict=True))
    assert not list(no_compiler.glob("kernels/*.so"))
