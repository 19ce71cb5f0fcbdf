from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from llmopt.errors import LlmoptError
from llmopt.group_size import valid_group_sizes
from llmopt.quant import QuantScheme, rtn_quantize
from llmopt.quant.fp8 import fp8_quantize
from llmopt.quant.qtensor import QuantizedWeight
from llmopt.quant.rtn import SIGNED_SCALE_BITS, fake_quantize, group_params, mse_params


def test_valid_group_sizes_for_smollm2_hidden():
    sizes = valid_group_sizes([576])
    assert 32 in sizes and 64 in sizes and 576 in sizes
    assert 128 not in sizes
    assert all(576 % g == 0 and g % 8 == 0 for g in sizes)


def test_ragged_group_size_is_a_one_line_user_error_naming_valid_sizes():
    with pytest.raises(LlmoptError) as e:
        QuantScheme(bits=4, group_size=128).check_in_features(576, "model.layers.0.self_attn.qkv_proj")
    msg = str(e.value)
    assert "\n" not in msg
    assert "128" in msg and "576" in msg and "qkv_proj" in msg
    assert "32" in msg and "64" in msg
    QuantScheme(bits=4, group_size=64).check_in_features(576)
    QuantScheme(bits=4, group_size=-1).check_in_features(576)
    with pytest.raises(LlmoptError):
        rtn_quantize(torch.randn(8, 576), QuantScheme(bits=4, group_size=128))


def test_scheme_validation():
    with pytest.raises(ValidationError):
        QuantScheme(bits=3)
    with pytest.raises(ValidationError):
        QuantScheme(group_size=0)
    with pytest.raises(ValidationError):
        QuantScheme(kind="fp8", bits=8, group_size=128)
    s = QuantScheme(bits=4, group_size=32, symmetric=False)
    assert s.maxq == 15 and s.sym_zero == 8 and s.n_groups(576) == 18
    assert QuantScheme(bits=8, group_size=-1).n_groups(576) == 1
    assert s.describe() == "int4 g32 asym"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, -1])
def test_rtn_codes_in_range_and_error_bounded(bits, sym, group_size):
    w = torch.randn(24, 128) * 0.1
    w[3] += 0.5  # an all-positive row: asym zero must stay >= 1 (GPTQ v1)
    scheme = QuantScheme(bits=bits, group_size=group_size, symmetric=sym)
    qw = rtn_quantize(w, scheme)
    assert qw.q.dtype == torch.uint8
    assert int(qw.q.max()) <= scheme.maxq
    if sym:
        assert qw.zero is None
        assert torch.equal(qw.zero_points(), torch.full_like(qw.zero_points(), 1 << (bits - 1)))
    else:
        assert 1 <= int(qw.zero.min()) and int(qw.zero.max()) <= scheme.maxq
    # scales are exactly representable in the storage dtype (fp16)
    assert torch.equal(qw.scale, qw.scale.half().float())
    deq = qw.dequantize()
    step = qw.scale[:, qw.g_idx.long()].abs()
    # every weight is within half a step (plus fp16 scale rounding slack at the range ends); symmetric int4
    # puts the signed extreme on -8 (Q4_0), which may clip the other side by up to one step
    bound = 1.0 if sym and bits in SIGNED_SCALE_BITS else 0.5
    assert bool(((deq - w).abs() <= bound * step * (1 + 1e-5)).all())
    if group_size == -1:
        assert qw.n_groups == 1


def test_rtn_symmetric_matches_gptq_convention():
    w = torch.tensor([[-1.5, -0.75, 0.0, 0.75] * 8])
    qw = rtn_quantize(w, QuantScheme(bits=4, group_size=-1, symmetric=True, scale_dtype="float32"))
    # the negative extreme lands exactly on code -8: scale = max(1.5 / 8, 0.75 / 7)
    assert torch.allclose(qw.scale, torch.tensor([[1.5 / 8]]))
    assert qw.q[0, :4].tolist() == [0, 4, 8, 12]  # round(w/s) + 8


def test_rtn_all_zero_rows_and_clip():
    w = torch.randn(4, 64)
    w[1] = 0
    qw = rtn_quantize(w, QuantScheme(bits=4, group_size=32, symmetric=False))
    assert torch.equal(qw.dequantize()[1], torch.zeros(64))
    clipped = rtn_quantize(w, QuantScheme(bits=4, group_size=32), clip_ratio=0.8)
    full = rtn_quantize(w, QuantScheme(bits=4, group_size=32))
    live = [0, 2, 3]  # row 1 is all zero (scale 1 either way)
    assert bool((clipped.scale[live].abs() <= full.scale[live].abs() * 0.8 * (1 + 2e-3)).all())
    max_val = torch.full((4, 2), 0.5)
    mv = rtn_quantize(w, QuantScheme(bits=4, group_size=32), max_val=max_val)
    assert float(mv.dequantize().abs().max()) <= 0.5 * (1 + 1 / 7) + 1e-3


def test_rtn_mse_option_lowers_power_error_on_heavy_tails():
    w = torch.distributions.StudentT(2.0).sample((16, 128))
    scheme = QuantScheme(bits=4, group_size=-1, symmetric=True, scale_dtype="float32")
    plain = rtn_quantize(w, scheme)
    mse = rtn_quantize(w, scheme, mse=True)
    err = lambda qw: float((qw.dequantize() - w).abs().pow(2.4).sum())  # noqa: E731
    # 0.90x here; the full-range min/max grid (nothing clipped) leaves the search less to win
    assert err(mse) < 0.95 * err(plain)


def test_quantized_weight_validates_shapes():
    scheme = QuantScheme(bits=4, group_size=32)
    q = torch.zeros(4, 64, dtype=torch.uint8)
    with pytest.raises(LlmoptError):
        QuantizedWeight(
            q=q, scale=torch.ones(4, 3), zero=None, g_idx=torch.zeros(64, dtype=torch.int32), scheme=scheme
        )
    with pytest.raises(LlmoptError):
        QuantizedWeight(
            q=q.to(torch.int32), scale=torch.ones(4, 2), zero=None, g_idx=torch.zeros(64), scheme=scheme
        )
    qw = QuantizedWeight(q=q, scale=torch.ones(4, 2), zero=None, g_idx=torch.arange(64) // 32, scheme=scheme)
    assert not qw.is_act_order and qw.nbytes() == 4 * 64 // 2 + 8 * 2


def test_weighted_range_search_follows_the_weights_and_never_loses_to_min_max():
    """GPTQ's range search weighs each column's squared error (by its Hessian diagonal): with a few heavy
    columns it picks ranges that are better where the weight is, at least as good as min/max by that measure,
    and better than the unweighted search's choice; the coarse-to-fine grid finds the exhaustive grid's error
    within a few percent."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g) ** 3  # heavy tails: clipping pays somewhere
    scheme = QuantScheme(bits=4, group_size=32, symmetric=True, scale_dtype="float32")
    h = torch.rand(128, generator=g) * 0.1
    h[::9] = 10.0  # a few inputs carry most of the output error

    def werr(scale, zero):  # weighted squared error of per-group (scale, zero) [64, 4]
        wg = w.reshape(64, 4, 32)
        return float(((fake_quantize(wg, scale[..., None], zero[..., None], scheme.maxq) - wg) ** 2
                      * h.reshape(4, 32)).sum())

    minmax = werr(*group_params(w, scheme))
    weighted = werr(*group_params(w, scheme, mse=True, weights=h))
    unweighted = werr(*group_params(w, scheme, mse=True))
    assert weighted <= minmax and weighted < 0.9 * unweighted, (weighted, unweighted, minmax)
    groups = w.reshape(-1, 32)
    wts = h.reshape(4, 32).repeat(64, 1)
    exhaustive = werr(*(t.reshape(64, 4) for t in mse_params(groups, scheme, weights=wts, coarse=1)))
    assert weighted <= 1.05 * exhaustive


@pytest.mark.parametrize("weighted", [False, True])
def test_mse_params_in_slabs_of_rows_is_the_same_search(monkeypatch, weighted):
    """Torch's range search (CUDA, or no C compiler) runs over slabs of rows to bound its temporaries; rows are
    independent, so the result is bitwise the one of a single pass, for weights per element or broadcast."""
    import llmopt.quant.rtn as rtn

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 32, generator=g)
    weights = torch.rand(300, 32, generator=g) if weighted else None
    scheme = QuantScheme(bits=4, group_size=32)
    given = [weights, weights[:1]] if weighted else [None]  # per element, and one row broadcast to all
    whole = [mse_params(w, scheme, weights=x, native=False) for x in given]
    monkeypatch.setattr(rtn, "MSE_ELEMENTS", 10 * 32 * 7)  # slabs of 7 rows, the last one shorter
    slabbed = [mse_params(w, scheme, weights=x, native=False) for x in given]
    for (s0, z0), (s1, z1) in zip(whole, slabbed, strict=True):
        assert torch.equal(s0, s1) and torch.equal(z0, z1)


def test_mse_params_memory_does_not_grow_with_the_weight(monkeypatch):
    """GPTQ's static groups hand the range search a whole weight ([out x groups, group] rows): torch's temporaries
    are bounded by MSE_ELEMENTS, not by the weight (5.60 GB of live tensors on Llama-3-8B's gate_proj before).
    (The C kernel's, test_range_search_kernel.py.)"""
    import llmopt.quant.rtn as rtn
    from llmopt.testing.live_bytes import LiveTensorBytes

    w = torch.randn(32768, 128)  # 16 MB in float32
    weights = torch.rand(32768, 128)
    scheme = QuantScheme(bits=4, group_size=128)
    peaks = {}
    for limit in (1 << 40, 1 << 20):  # unbounded, then 4 MB a temporary
        monkeypatch.setattr(rtn, "MSE_ELEMENTS", limit)
        with LiveTensorBytes() as m:
            mse_params(w, scheme, weights=weights, native=False)
        peaks[limit] = m.peak
    assert peaks[1 << 40] > 300e6  # 10 candidates x the weight, in several temporaries
    assert peaks[1 << 20] < 64e6


def _whole_dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The definition, over the whole weight at once: scale x (code - zero), per column's group."""
    idx = qw.g_idx.long()
    if qw.scheme.kind == "fp8":
        return qw.q.float() * qw.scale.float()[:, idx]
    return (qw.q.to(torch.int32) - qw.zero_points()[:, idx]).float() * qw.scale.float()[:, idx]


@pytest.mark.parametrize("scheme", [QuantScheme(bits=4, group_size=32), QuantScheme(bits=4, group_size=64, symmetric=False),
                                    QuantScheme(bits=8, group_size=-1)], ids=lambda s: s.describe())
def test_quantize_and_dequantize_by_blocks_of_rows_are_the_whole_weights_values(monkeypatch, scheme):
    """RTN's codes and `dequantize` work a block of rows at a time (an 8B down_proj's whole-weight temporaries
    were ~2 GB); blocks of 7 rows, the last one shorter, give bitwise the codes and floats of one block, for
    contiguous and act-order groups and fp8 weights, in float32 and bf16."""
    import llmopt.quant.qtensor as qtensor

    g = torch.Generator().manual_seed(0)
    w = torch.randn(100, 128, generator=g)
    whole = rtn_quantize(w, scheme)
    monkeypatch.setattr(qtensor, "BLOCK_ELEMENTS", 7 * 128)
    blocked = rtn_quantize(w, scheme)
    assert torch.equal(blocked.q, whole.q) and torch.equal(blocked.scale, whole.scale)
    perm = torch.randperm(128, generator=g)  # act-order: each column's group by a permutation
    shuffled = QuantizedWeight(q=whole.q, scale=whole.scale, zero=whole.zero, g_idx=whole.g_idx[perm], scheme=scheme)
    fp8 = fp8_quantize(w)
    for qw in (whole, shuffled, fp8):
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(qw.dequantize(dtype), _whole_dequantize(qw).to(dtype))


def test_quantize_and_dequantize_allocate_little_beyond_their_results(monkeypatch):
    """Live tensor bytes of RTN and of `dequantize` to float32, one block (as before) against 16 blocks of 64
    rows. Each count includes the float32 weight itself (an input seen through a view, or the result) and the
    codes (0.25 of it); beyond those, one block's temporaries (~0.27) where whole-weight ones were ~4x it."""
    import llmopt.quant.qtensor as qtensor
    from llmopt.testing.live_bytes import LiveTensorBytes

    w = torch.randn(1024, 4096)  # 16 MB in float32
    scheme = QuantScheme(bits=4, group_size=128)
    peaks = {}
    for block in (w.numel(), w.numel() // 16):
        monkeypatch.setattr(qtensor, "BLOCK_ELEMENTS", block)
        with LiveTensorBytes() as quantizing:
            qw = rtn_quantize(w, scheme)
        with LiveTensorBytes() as dequantizing:
            qw.dequantize(torch.float32)
        peaks[block] = (quantizing.peak / (w.numel() * 4), dequantizing.peak / (w.numel() * 4))
    whole, blocked = peaks.values()
    assert all(x >= 4.0 for x in whole), whole  # 5.27 and 4.26 here
    assert all(x <= 1.6 for x in blocked), blocked  # 1.52 and 1.45


@pytest.mark.parametrize("clip", [False, True])
def test_group_ranges_by_blocks_of_rows_are_exact_and_need_no_float_copy(monkeypatch, clip):
    """`group_params`' min/max (RTN's ranges) go a block of rows at a time: a bf16 weight (an 8B head) was widened
    whole, and AWQ's clip clamped the whole copy twice more. The same scales and zeros, bitwise; new allocations a
    fraction of the float32 weight."""
    import llmopt.quant.qtensor as qtensor
    from llmopt.quant.rtn import group_params
    from llmopt.testing.live_bytes import LiveTensorBytes

    w = torch.randn(512, 1024).to(torch.bfloat16)
    scheme = QuantScheme(bits=4, group_size=32, symmetric=False)
    max_val = w.float().reshape(512, 32, 32).abs().amax(-1) * 0.8 if clip else None
    runs = []
    for block in (w.numel(), 64 * 1024):  # one block (as before), then blocks of 64 rows
        monkeypatch.setattr(qtensor, "BLOCK_ELEMENTS", block)
        with LiveTensorBytes() as m:
            runs.append((group_params(w, scheme, clip_ratio=0.9, max_val=max_val), m.peak / (w.numel() * 4)))
    (whole, whole_peak), (blocked, blocked_peak) = runs
    assert torch.equal(blocked[0], whole[0]) and torch.equal(blocked[1], whole[1])
    # both count the bf16 weight (0.5: seen through views); the whole one its float32 copy too (1.0, and the
    # clamp's 2.0 more), the blocked one a block's worth
    assert blocked_peak <= whole_peak - (2.2 if clip else 0.8), (whole_peak, blocked_peak)  # 3.56 -> 1.09, 1.87 -> 0.99
