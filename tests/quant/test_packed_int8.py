"""W8A16 linears in VNNI pairs (`PackedInt8Linear`): the same matmul as `Int8WeightOnlyLinear` at every batch
shape the kernel splits differently, the same state_dict, and swapped in only where it applies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmopt.layers.linear import FusedLinear
from llmopt.layers.packed_linear import vnni_kernel
from llmopt.quant import Int8WeightOnlyLinear, QuantScheme, rtn_quantize
from llmopt.quant.packed_int8 import PackedInt8Linear, pack_int8_linears
from llmopt.testing.rounding import within_bf16_linear_bound

needs_vnni = pytest.mark.skipif(vnni_kernel() is None, reason="no AVX512-BF16 (or no C compiler) here")


def _int8(n: int, k: int, seed: int, symmetric: bool = True, bias: bool = False,
          dtype: torch.dtype = torch.bfloat16) -> Int8WeightOnlyLinear:
    g = torch.Generator().manual_seed(seed)
    qw = rtn_quantize(torch.randn(n, k, generator=g) * 0.05, QuantScheme(bits=8, group_size=-1, symmetric=symmetric))
    b = torch.randn(n, generator=g) if bias else None
    return Int8WeightOnlyLinear.from_quantized(qw, bias=b, compute_dtype=dtype)


@needs_vnni
@pytest.mark.parametrize("path", ["vnni", "fma", "amx"])
@pytest.mark.parametrize(("n", "k", "bias"), [(7, 48, False), (130, 576, True), (1000, 96, False)])
def test_packed_int8_matches_the_int8_linear(n, k, bias, path, monkeypatch):
    """Passes of up to 6 rows (int8 converted per pass, to bf16 for vdpbf16ps or, `fma`, to float32: up to 4 rows
    over the whole panel, then up to 12 over one vector, never widened), past 16 rows each panel widened once per work item,
    AMX tiles over widened panels, partial vectors and panels: each path within the float32-summation bound
    (llmopt.testing.rounding) of the float64 matmul over the int8 weight and its bf16 scales, and close to the
    module it replaces (another kernel, another order). K = 48 is no multiple of an AMX tile's 32: VNNI always."""
    kernel = vnni_kernel()
    if path == "amx" and not kernel.amx:
        pytest.skip("the CPU has no amx_bf16 (or Linux refused the AMX tile state)")
    monkeypatch.setitem(kernel.amx_min_rows, torch.int8, 1 if path == "amx" else 10**9)
    monkeypatch.setattr(kernel, "fma", path == "fma")  # passes in float32 FMAs, or vdpbf16ps
    mod = _int8(n, k, n + k, bias=bias)
    packed = PackedInt8Linear(mod, kernel)
    g = torch.Generator().manual_seed(5)
    for rows in (1, 3, 4, 5, 6, 7, 12, 13, 16, 17, 33, 48, 49, 100, 300):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        got = packed(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        ok, worst = within_bf16_linear_bound(got, x, mod.weight, packed.bias, packed.scales)
        amx = kernel.uses_amx(rows, k, torch.int8)
        assert ok, f"{rows} rows on {'AMX tiles' if amx else 'AVX512-BF16 pairs'}: error {worst:.2f}x the bound"
        old = mod(x).float()
        assert torch.allclose(got.float(), old, rtol=2**-6, atol=1e-2), rows
    assert packed(torch.randn(2, 5, k).to(torch.bfloat16)).shape == (2, 5, n)


@needs_vnni
def test_packed_int8_state_dict_is_the_int8_linear_s():
    mod = _int8(70, 64, 1, bias=True)
    packed = PackedInt8Linear(mod, vnni_kernel())
    a, b = mod.state_dict(), packed.state_dict()
    assert torch.equal(b["weight"], a["weight"]) and b["weight"].dtype == torch.int8
    assert torch.equal(b["scales"], a["scales"])
    assert torch.equal(b["bias"].float(), a["bias"].to(torch.bfloat16).float())
    assert torch.equal(packed.dequantize(), mod.dequantize())


@needs_vnni
def test_pack_int8_linears_swaps_only_what_it_takes():
    model = nn.Module()
    model.sym = _int8(32, 64, 2)
    model.asym = _int8(32, 64, 3, symmetric=False)  # a zero point: the general path's correction
    model.fp32 = _int8(32, 64, 4, dtype=torch.float32)
    model.eager = _int8(32, 64, 5)
    model.eager.native_kernel = False  # enforce_eager
    fused = FusedLinear(64, {"q": 16, "k": 16}, bias=False, dtype=torch.float32)
    model.fused = _int8(32, 64, 6)
    model.fused.output_splits = dict(fused.output_splits)
    assert pack_int8_linears(model) == 2
    assert isinstance(model.sym, PackedInt8Linear) and isinstance(model.fused, PackedInt8Linear)
    assert model.fused.output_splits == {"q": (0, 16), "k": (16, 32)}
    assert all(type(getattr(model, n)) is Int8WeightOnlyLinear for n in ("asym", "fp32", "eager"))


def test_pack_int8_linears_leaves_modules_alone_without_a_compiler(no_compiler):
    model = nn.Module()
    model.sym = _int8(32, 64, 2)
    assert pack_int8_linears(model) == 0 and type(model.sym) is Int8WeightOnlyLinear
