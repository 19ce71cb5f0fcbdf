from __future__ import annotations

import pytest
import torch
from _qhelpers import correlated_inputs

from llmopt.errors import LlmoptError
from llmopt.quant import (
    QuantScheme,
    gptq_quantization_config,
    gptq_quantize,
    pack_gptq,
    pack_int32,
    rtn_quantize,
    unpack_gptq,
    unpack_int32,
)


def test_lsb_first_packing_by_hand():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]], dtype=torch.uint8)
    word = pack_int32(codes, 4, dim=1)
    # element j in bits [4j, 4j+4): 0xF7654321 as a signed int32
    assert word.tolist() == [[0xF7654321 - 2**32]]
    assert torch.equal(unpack_int32(word, 4, dim=1, count=8), codes)
    b8 = pack_int32(torch.tensor([[0x01, 0x80, 0xFF, 0x7F]], dtype=torch.uint8), 8, dim=1)
    assert b8.tolist() == [[0x7FFF8001]]
    col = pack_int32(torch.arange(8, dtype=torch.uint8).reshape(8, 1), 4, dim=0)
    assert col.shape == (1, 1) and col.item() == 0x76543210


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_packing_by_blocks_of_rows_is_the_word_by_word_packing(bits, dim, monkeypatch):
    """`pack_int32` / `unpack_int32` go a block of rows at a time (an 8B int4 head's int64 arithmetic was 4.2 GB
    taken whole): the words of plain shifts, a short last word padded, and allocations a fraction of the codes'
    int64 widening."""
    import llmopt.quant.qtensor as qtensor
    from llmopt.testing.live_bytes import LiveTensorBytes

    monkeypatch.setattr(qtensor, "BLOCK_ELEMENTS", 1 << 10)
    per = 32 // bits
    torch.manual_seed(0)
    codes = torch.randint(0, 1 << bits, (203, 517), dtype=torch.uint8)  # neither dimension a multiple of per
    c = codes.t() if dim == 0 else codes
    words = -(-c.shape[1] // per)
    expected = torch.zeros(c.shape[0], words, dtype=torch.int64)
    for j in range(per):
        part = c[:, j::per].to(torch.int64) << (bits * j)
        expected[:, : part.shape[1]] |= part
    expected = torch.where(expected >= 2**31, expected - 2**32, expected).to(torch.int32)
    with LiveTensorBytes() as packing:
        packed = pack_int32(codes, bits, dim=dim)
    assert torch.equal(packed, expected.t() if dim == 0 else expected)
    with LiveTensorBytes() as unpacking:
        back = unpack_int32(packed, bits, dim=dim, count=codes.shape[dim])
    assert torch.equal(back, codes)
    widened = codes.numel() * 8  # the int64 copy of the codes, the smallest whole-tensor temporary before
    assert packing.peak < widened and unpacking.peak < widened, (packing.peak, unpacking.peak, widened)


def _reference_dequant_gptq(t: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """Dequantize GPTQ tensors the way the AutoGPTQ/exllama readers do, with plain shifts."""
    per = 32 // bits
    mask = (1 << bits) - 1
    qweight = t["qweight"].to(torch.int64) & 0xFFFFFFFF
    in_f, out_f = qweight.shape[0] * per, qweight.shape[1]
    w = torch.empty(in_f, out_f, dtype=torch.int64)
    for j in range(per):
        w[j::per] = (qweight >> (bits * j)) & mask
    qz = t["qzeros"].to(torch.int64) & 0xFFFFFFFF
    z = torch.empty(qz.shape[0], out_f, dtype=torch.int64)
    for j in range(per):
        z[:, j::per] = (qz >> (bits * j)) & mask
    z = z + 1  # v1
    g = t["g_idx"].long()
    return ((w - z[g]).float() * t["scales"].float()[g]).t()


@pytest.mark.parametrize(
    "scheme, act_order",
    [
        (QuantScheme(bits=4, group_size=32, symmetric=True), False),
        (QuantScheme(bits=4, group_size=32, symmetric=False), False),
        (QuantScheme(bits=4, group_size=32, symmetric=True), True),
        (QuantScheme(bits=4, group_size=-1, symmetric=False), False),
        (QuantScheme(bits=8, group_size=-1, symmetric=True), False),
        (QuantScheme(bits=8, group_size=64, symmetric=False), True),
    ],
    ids=lambda v: v.describe() if isinstance(v, QuantScheme) else f"act_order={v}",
)
def test_gptq_pack_roundtrip_is_exact(scheme, act_order):
    x = correlated_inputs(256, 128) * torch.linspace(0.2, 2, 128)
    w = torch.randn(40, 128) * 0.05
    w[0] += 0.3  # an all-positive row exercises the smallest asym zero
    qw, _ = gptq_quantize(w, 2 * x.t() @ x / 256, scheme, act_order=act_order, static_groups=False)
    t = pack_gptq(qw)
    per = 32 // scheme.bits
    groups = 1 if scheme.group_size == -1 else 128 // scheme.group_size
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (128 // per, 40)
    assert t["qzeros"].dtype == torch.int32 and t["qzeros"].shape == (groups, 40 // per)
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (groups, 40)
    assert t["g_idx"].dtype == torch.int32 and torch.equal(t["g_idx"], qw.g_idx)
    back = unpack_gptq(
        t["qweight"], t["qzeros"], t["scales"], t["g_idx"], scheme.bits, scheme.group_size, scheme.symmetric
    )
    assert (
        torch.equal(back.q, qw.q) and torch.equal(back.scale, qw.scale) and torch.equal(back.g_idx, qw.g_idx)
    )
    assert (back.zero is None) == (qw.zero is None)
    if qw.zero is not None:
        assert torch.equal(back.zero, qw.zero)
    assert torch.equal(back.dequantize(), qw.dequantize())
    assert torch.equal(_reference_dequant_gptq(t, scheme.bits), qw.dequantize())


def test_symmetric_zeros_are_stored_as_half_range_minus_one():
    t4 = pack_gptq(rtn_quantize(torch.randn(16, 64), QuantScheme(bits=4, group_size=32)))
    assert torch.equal(t4["qzeros"], torch.full((2, 2), 0x77777777, dtype=torch.int32))
    t8 = pack_gptq(rtn_quantize(torch.randn(16, 64), QuantScheme(bits=8, group_size=-1)))
    assert torch.equal(t8["qzeros"], torch.full((1, 4), 0x7F7F7F7F, dtype=torch.int32))


def test_gptq_pack_rejects_unpackable_shapes_and_wrong_sym():
    with pytest.raises(LlmoptError):
        pack_gptq(rtn_quantize(torch.randn(12, 64), QuantScheme(bits=4, group_size=32)))
    t = pack_gptq(rtn_quantize(torch.randn(16, 64), QuantScheme(bits=4, group_size=32, symmetric=False)))
    with pytest.raises(LlmoptError):
        unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 32, sym=True)
    with pytest.raises(LlmoptError):
        unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 16, sym=False)


def test_gptq_quantization_config_keys():
    cfg = gptq_quantization_config(QuantScheme(bits=4, group_size=64), desc_act=True, static_groups=True)
    assert cfg["quant_method"] == "gptq" and cfg["checkpoint_format"] == "gptq"
    assert cfg["bits"] == 4 and cfg["group_size"] == 64 and cfg["sym"] is True
    assert cfg["desc_act"] is True and cfg["static_groups"] is True
    assert {"damp_percent", "true_sequential", "lm_head", "pack_dtype", "meta"} <= set(cfg)
    assert gptq_quantization_config(QuantScheme(bits=8, group_size=-1))["group_size"] == -1
