"""Our scale / zero-point / rounding math against compressed-tensors' own functions (the library that
llm-compressor and vLLM share), on random weights with outliers: symmetric and asymmetric, int4 and int8,
groups and channels.

* asymmetric: our (scale, zero) are exactly `calculate_qparams`'s (zero shifted by 2^(bits-1): we keep
  unsigned codes), for every range that includes 0 on both sides;
* symmetric: deliberately not `calculate_qparams` (absmax / 7.5, which always clips a group's extreme
  by half a step): int8's is the smallest scale with which the library's own `quantize` clips nothing;
  int4's is Q4_0's signed extreme / -8, on which the library's `quantize` puts the extreme at -8 exactly;
* codes and dequantized weights of RTN, GPTQ and AWQ are exactly what the library's `quantize` /
  `fake_quantize` produce with our parameters (so checkpoint readers see what we optimized).
"""

from __future__ import annotations

import pytest
import torch

from llmopt.quant.awq import awq_search_clip
from llmopt.quant.gptq import gptq_quantize
from llmopt.quant.rtn import group_params, params_from_range, rtn_quantize
from llmopt.quant.scheme import QuantScheme

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize, quantize  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

CASES = [(4, 64), (4, -1), (8, 64), (8, -1)]
IDS = ["int4-g64", "int4-channel", "int8-g64", "int8-channel"]


def _weights(rows: int = 24, cols: int = 256, seed: int = 0) -> torch.Tensor:
    """Gaussian weights with ~1% outliers 10-30x larger, of both signs, some groups all-positive-heavy."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    mask = torch.rand(rows, cols, generator=g) < 0.01
    w[mask] *= 10 + 20 * torch.rand(int(mask.sum()), generator=g)
    w[3, :64] = w[3, :64].abs() + 0.01  # a group with no negative weight (asym: zero at the range end)
    w[5, 64:128] = -w[5, 64:128].abs()  # and one with no positive weight
    return w


def _args(bits: int, group_size: int, symmetric: bool) -> QuantizationArgs:
    if group_size == -1:
        return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="channel")
    return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group", group_size=group_size)


def _ranges(w: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    gs = scheme.effective_group_size(w.shape[1])
    g = w.reshape(w.shape[0], -1, gs)
    return g.amin(-1), g.amax(-1)


def _ct_zero(zero: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Our unsigned zero (sym: 2^(bits-1)) as compressed-tensors' signed zero point."""
    return (zero - scheme.sym_zero).to(torch.int8)


@pytest.mark.parametrize(("bits", "group_size"), CASES, ids=IDS)
def test_asymmetric_scale_and_zero_equal_calculate_qparams(bits, group_size):
    w = _weights()
    scheme = QuantScheme(bits=bits, group_size=group_size, symmetric=False, scale_dtype="float32")
    lo, hi = _ranges(w, scheme)
    both_sides = (lo < 0) & (hi > 0)
    ours_s, ours_z = params_from_range(lo, hi, scheme)
    ct_s, ct_z = calculate_qparams(lo, hi, _args(bits, group_size, symmetric=False))
    # ranges touching 0 (rows 3 and 5 above) are the one place we differ: we widen the step so that
    # the zero stays >= 1 (GPTQ v1 stores zero - 1); both still cover the range
    keep = both_sides & (ours_z >= 1)
    assert keep.float().mean() > 0.9
    assert torch.equal(ours_s[keep], ct_s.float()[keep])
    assert torch.equal(_ct_zero(ours_z, scheme)[keep], ct_z[keep])


@pytest.mark.parametrize(("bits", "group_size"), CASES[2:], ids=IDS[2:])
def test_symmetric_scale_is_the_smallest_that_clips_nothing(bits, group_size):
    w = _weights()
    scheme = QuantScheme(bits=bits, group_size=group_size, symmetric=True, scale_dtype="float32")
    args = _args(bits, group_size, symmetric=True)
    lo, hi = _ranges(w, scheme)
    ours, _ = params_from_range(lo, hi, scheme)
    zp = torch.zeros_like(ours, dtype=torch.int8)
    half = scheme.sym_zero
    gs = scheme.effective_group_size(w.shape[1])

    def worst_error_in_steps(scale: torch.Tensor) -> torch.Tensor:
        deq = fake_quantize(w, scale, zp, args)
        err = (deq - w).abs().reshape(w.shape[0], -1, gs).amax(-1)
        return err / scale

    # the library's quantizer with our scale: every weight within half a step, the extreme exact
    assert bool((worst_error_in_steps(ours) <= 0.5 + 1e-5).all())
    codes = quantize(w, ours, zp, args).reshape(w.shape[0], -1, gs)
    # the side that sets the scale lands exactly on its end code: -2^(bits-1) or 2^(bits-1) - 1
    extreme = torch.where(-lo / half >= hi / (half - 1), torch.full_like(lo, -half), torch.full_like(lo, half - 1))
    assert bool(((codes == extreme[..., None]).any(-1)).all())
    # 0.1% smaller and every group has a weight outside the code range (clipped)
    smaller = (w.reshape(w.shape[0], -1, gs) / (ours * 0.999)[..., None])
    assert bool(((smaller < -half) | (smaller > half - 1)).any(-1).all())
    # compressed-tensors' own symmetric scale is absmax / ((2^bits - 1) / 2): it clips each extreme
    ct_s, _ = calculate_qparams(lo, hi, args)
    assert torch.allclose(ct_s, torch.maximum(-lo, hi) / ((2**bits - 1) / 2))
    pos = hi >= -lo  # a positive extreme is clamped to (half - 1) * s: exactly half a step short
    assert torch.allclose(worst_error_in_steps(ct_s)[pos], torch.full_like(ct_s[pos], 0.5), atol=1e-4)


@pytest.mark.parametrize("group_size", [64, -1], ids=["g64", "channel"])
def test_int4_symmetric_scale_puts_the_signed_extreme_on_minus_8(group_size):
    """Q4_0's rule: scale = extreme / -8, signed, so the group's largest-magnitude weight is exact at code -8
    whichever its sign (8 steps up to a positive one where a positive scale gives 7); a weight on the other
    side past 7 steps is clipped to the last code, within one step."""
    w = _weights()
    scheme = QuantScheme(bits=4, group_size=group_size, symmetric=True, scale_dtype="float32")
    args = _args(4, group_size, symmetric=True)
    lo, hi = _ranges(w, scheme)
    ours, _ = params_from_range(lo, hi, scheme)
    extreme = torch.where(-lo >= hi, lo, hi)
    assert torch.equal(ours, extreme / -8)
    assert bool((ours < 0).any() and (ours > 0).any())
    zp = torch.zeros_like(ours, dtype=torch.int8)
    gs = scheme.effective_group_size(w.shape[1])
    codes = quantize(w, ours, zp, args).reshape(w.shape[0], -1, gs)
    deq = fake_quantize(w, ours, zp, args).reshape(w.shape[0], -1, gs)
    at_extreme = w.reshape(w.shape[0], -1, gs) == extreme[..., None]
    assert bool((codes[at_extreme] == -8).all()) and torch.equal(deq[at_extreme], w.reshape(deq.shape)[at_extreme])
    err = (deq - w.reshape(deq.shape)).abs() / ours.abs()[..., None]
    clipped = w.reshape(deq.shape) / ours[..., None] > 7.5  # the other side, past the last code
    assert bool((err[~clipped] <= 0.5 + 1e-5).all()) and bool((err <= 1 + 1e-5).all())


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
@pytest.mark.parametrize(("bits", "group_size"), CASES, ids=IDS)
def test_rtn_codes_and_weights_equal_the_library_quantizer(bits, group_size, symmetric, scale_dtype):
    w = _weights(seed=1)
    scheme = QuantScheme(bits=bits, group_size=group_size, symmetric=symmetric, scale_dtype=scale_dtype)
    qw = rtn_quantize(w, scheme)
    args = _args(bits, group_size, symmetric)
    zp = _ct_zero(qw.zero_points(), scheme)
    codes = quantize(w, qw.scale, zp, args)
    assert torch.equal(codes.to(torch.int32), qw.q.to(torch.int32) - scheme.sym_zero)
    assert torch.equal(fake_quantize(w, qw.scale, zp, args), qw.dequantize())
    if scale_dtype == "float16":  # fp16-representable scales, as the checkpoints store them
        assert torch.equal(qw.scale, qw.scale.half().float())


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "act-order"])
def test_gptq_and_awq_weights_are_fixed_points_of_the_library_quantizer(symmetric, act_order):
    """What GPTQ and AWQ write is on the library's grid: re-quantizing the dequantized weight with the
    stored parameters reproduces the stored codes."""
    w = _weights(rows=32, seed=2)
    x = torch.randn(512, 256) * (1 + 5 * (torch.arange(256) % 17 == 0))
    scheme = QuantScheme(bits=4, group_size=64, symmetric=symmetric)
    args = _args(4, 64, symmetric)
    H = 2 * x.t() @ x / x.shape[0]
    gq, _ = gptq_quantize(w, H, scheme, act_order=act_order, static_groups=True)
    clip = awq_search_clip(x, w, scheme)
    aq = rtn_quantize(w, scheme, max_val=clip)
    for qw in (gq, aq):
        zp = _ct_zero(qw.zero_points(), scheme)
        deq = qw.dequantize()
        assert torch.equal(quantize(deq, qw.scale, zp, args).to(torch.int32), qw.q.to(torch.int32) - 8)
        assert torch.equal(fake_quantize(deq, qw.scale, zp, args), deq)
    # GPTQ with static groups keeps RTN's parameters
    s0, _ = group_params(w, scheme)
    assert torch.equal(gq.scale, s0)
