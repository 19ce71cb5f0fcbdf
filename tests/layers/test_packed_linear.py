"""Packed bf16/fp16 linears (CPU engines), on our VNNI-pair kernel or oneDNN's layout: the same results as
F.linear, swapped in only where they apply, and an engine that packs generating what an eager one does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import llmopt.native as native
from llmopt import LLM, SamplingParams
from llmopt.layers.linear import FusedLinear
from llmopt.layers.moe import SparseMoeBlock
from llmopt.layers.packed_linear import (
    PackedLinear,
    onednn_supported,
    pack_linears,
    pack_vnni,
    packing_supported,
    unpack_vnni,
    vnni_kernel,
)
from llmopt.quant.linear import Int8WeightOnlyLinear
from llmopt.quant.rtn import rtn_quantize
from llmopt.quant.scheme import QuantScheme
from llmopt.testing.rounding import within_bf16_linear_bound
from llmopt.testing.tiny_model import write_tiny_moe
from tests.conftest import build_avx2

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(not packing_supported(torch.bfloat16, CPU),
                                   reason="this torch build's oneDNN has no bf16 matmul")
needs_vnni = pytest.mark.skipif(vnni_kernel() is None, reason="no AVX512-BF16 or AVX2 (or no C compiler) here")


def _linear(n: int, k: int, bias: bool, dtype: torch.dtype, g: torch.Generator) -> nn.Linear:
    lin = nn.Linear(k, n, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin


def _path(packed: PackedLinear, rows: int) -> str:
    """Which kernel ran a call, for failure messages: a result that depends on the CPU names its cause."""
    if packed.kernel is None:
        return "oneDNN's packed layout"
    amx = packed.kernel.uses_amx(rows, packed.in_features, packed.dtype)
    return f"{'AMX tiles' if amx else 'AVX512-BF16 pairs'} (CPU has amx_bf16: {native.cpu_has('amx_bf16')})"


@needs_packing
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("vnni", [False, True])
def test_packed_linear_matches_f_linear(dtype, bias, vnni):
    """Decode and prefill sizes. Which kernel runs a bf16 call (our AMX tiles or AVX512-BF16 pairs, oneDNN's
    own choice by shape and CPU) sets the summation order, so no two need agree bitwise: ours and F.linear
    are each held to the bound every float32-summing kernel meets (llmopt.testing.rounding), against float64."""
    if not (vnni and dtype == torch.bfloat16 and vnni_kernel() is not None) and not onednn_supported(dtype):
        pytest.skip(f"no oneDNN {dtype} matmul here")
    g = torch.Generator().manual_seed(0)
    lin = _linear(200, 96, bias, dtype, g)
    packed = PackedLinear(lin, vnni=vnni)
    assert (packed.kernel is not None) == (vnni and dtype == torch.bfloat16 and vnni_kernel() is not None)
    for rows in (1, 3, 16, 300):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        got, want = packed(x), F.linear(x, lin.weight, lin.bias)
        if dtype == torch.bfloat16:
            ok, worst = within_bf16_linear_bound(got, x, lin.weight, lin.bias)
            assert ok, f"{rows} rows on {_path(packed, rows)}: error {worst:.2f}x the float32-summation bound"
            ok, worst = within_bf16_linear_bound(want, x, lin.weight, lin.bias)
            assert ok, f"F.linear at {rows} rows: error {worst:.2f}x the bound (the bound's premise)"
        else:  # torch's fp16 F.linear on a CPU is another kernel: the same up to fp16 rounding
            assert torch.allclose(got, want, atol=1e-2, rtol=1e-3)
    x = torch.randn(2, 150, 96, generator=g).to(dtype)  # a prefill-sized 3-D batch
    got = packed(x)
    assert got.shape == (2, 150, 200) and got.dtype == dtype
    if dtype == torch.bfloat16:
        assert within_bf16_linear_bound(got.view(300, 200), x.view(300, 96), lin.weight, lin.bias)[0]
    else:
        want = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
        assert torch.allclose(got.float(), want, atol=0.1, rtol=0.02)
    assert torch.equal(packed.weight, lin.weight)  # unpacks back exactly
    assert torch.equal(packed.state_dict()["weight"], lin.weight)


@needs_vnni
@pytest.mark.parametrize("path", ["vnni", "fma", "amx"])
@pytest.mark.parametrize(("n", "k"), [(7, 34), (64, 64), (130, 576), (1000, 96)])
def test_kernel_paths_meet_the_float32_summation_bound_at_every_batch_shape(n, k, path, monkeypatch):
    """Outputs that are not a whole vector or panel (n % 16, n % 64), batches that end mid-pass (6 rows), mid
    tile (16) or mid work item (32, 48), past x's conversion to float32 in blocks (`fma`, 300): each path, forced,
    within the float32-summation bound of float64 (`fma`: bf16 in float32 passes from 2 rows).
    K = 34 is no multiple of an AMX tile's 32: that call takes the VNNI path on every CPU."""
    kernel = vnni_kernel()
    if path == "amx" and not kernel.amx:
        pytest.skip("the CPU has no amx_bf16 (or Linux refused the AMX tile state)")
    monkeypatch.setitem(kernel.amx_min_rows, torch.bfloat16, 1 if path == "amx" else 10**9)
    monkeypatch.setattr(kernel, "fma", path == "fma")
    g = torch.Generator().manual_seed(1)
    lin = _linear(n, k, True, torch.bfloat16, g)
    packed = PackedLinear(lin)
    assert packed.kernel is kernel
    for rows in (1, 2, 5, 6, 7, 13, 15, 16, 17, 31, 32, 33, 47, 48, 49, 100, 300):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        got = packed(x)
        assert got.shape == (rows, n)
        ok, worst = within_bf16_linear_bound(got, x, lin.weight, lin.bias)
        assert ok, f"{rows} rows on {_path(packed, rows)}: error {worst:.2f}x the bound"


@needs_vnni
@pytest.mark.parametrize("path", ["vnni", "fma", "amx"])
def test_a_row_is_the_same_alone_or_in_any_batch(path, monkeypatch):
    """Bitwise, by construction: a row's sums come from its own x row in one fixed order (VNNI passes and AMX
    tile rows are independent of each other), so while one path runs, batching never changes a result. bf16
    takes AMX tiles from one row where the CPU has them (AMX_MIN_ROWS), so an engine's bf16 linears are
    batch-invariant on both kinds of CPU. `fma` (Intel cores without AMX): from 2 rows bf16 runs float32 passes
    in vdpbf16ps's own order and roundings, so a row of 1 (vdpbf16ps) and of 300 (float32, x converted in blocks)
    agree too."""
    kernel = vnni_kernel()
    if path == "amx" and not kernel.amx:
        pytest.skip("the CPU has no amx_bf16 (or Linux refused the AMX tile state)")
    monkeypatch.setitem(kernel.amx_min_rows, torch.bfloat16, 1 if path == "amx" else 10**9)
    monkeypatch.setattr(kernel, "fma", path == "fma")
    g = torch.Generator().manual_seed(4)
    packed = PackedLinear(_linear(200, 576, True, torch.bfloat16, g))
    x = torch.randn(300, 576, generator=g).to(torch.bfloat16)
    batched = packed(x)
    for i in (0, 5, 16, 17, 33, 99, 299):
        assert torch.equal(packed(x[i:i + 1]), batched[i:i + 1]), i
    assert torch.equal(packed(x[:40]), batched[:40])


@needs_vnni
def test_vnni_pack_keeps_every_weight_once_in_pairs():
    w = (torch.arange(70 * 6, dtype=torch.float32) % 251).view(70, 6).to(torch.bfloat16)  # integers < 256: exact
    flat = pack_vnni(w)
    assert flat.numel() == 80 * 6  # 70 rows padded to 80 with zeros
    # panel 0 (outputs 0-63), pair row 0: w[0,0], w[0,1], w[1,0], w[1,1], ...
    assert flat[:4].tolist() == [w[0, 0].item(), w[0, 1].item(), w[1, 0].item(), w[1, 1].item()]
    assert torch.equal(unpack_vnni(flat, 70, 6), w)


def test_packed_linear_keeps_onednn_layout_without_a_compiler(no_compiler):
    """No C compiler: the bf16 linear packs for oneDNN instead, and still computes F.linear."""
    if not packing_supported(torch.bfloat16, CPU):
        pytest.skip("this torch build's oneDNN has no bf16 matmul")
    lin = _linear(40, 32, False, torch.bfloat16, torch.Generator().manual_seed(2))
    packed = PackedLinear(lin)
    assert packed.kernel is None and "onednn" in repr(packed)
    x = torch.randn(3, 32).to(torch.bfloat16)
    ok, worst = within_bf16_linear_bound(packed(x), x, lin.weight)  # another oneDNN primitive than F.linear's
    assert ok, f"oneDNN's packed linear: error {worst:.2f}x the float32-summation bound"


@needs_packing
def test_pack_linears_swaps_only_plain_low_precision_linears():
    model = nn.Module()
    model.embed = nn.Embedding(50, 32, dtype=torch.bfloat16)
    model.qkv = FusedLinear(32, {"q": 32, "k": 16, "v": 16}, bias=False, dtype=torch.bfloat16)
    model.fp32 = nn.Linear(32, 32)
    hooked = nn.Linear(32, 32, dtype=torch.bfloat16)
    hooked.register_forward_hook(lambda *a: None)
    model.hooked = hooked
    w = torch.randn(32, 32)
    model.int8 = Int8WeightOnlyLinear.from_quantized(rtn_quantize(w, QuantScheme(bits=8, group_size=-1)))
    model.head = nn.Linear(32, 50, bias=False, dtype=torch.bfloat16)
    model.head.weight = model.embed.weight  # tied: the head gets a packed copy, the embedding keeps its own
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert pack_linears(model) == 2
    assert isinstance(model.qkv, PackedLinear) and model.qkv.output_splits == {"q": (0, 32), "k": (32, 48),
                                                                                "v": (48, 64)}
    assert isinstance(model.head, PackedLinear)
    assert type(model.fp32) is nn.Linear and type(model.hooked) is nn.Linear
    assert isinstance(model.int8, Int8WeightOnlyLinear)
    assert isinstance(model.embed.weight, nn.Parameter) and not model.embed.weight.is_mkldnn
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


@needs_packing
def test_pack_linears_packs_moe_experts_for_the_c_block(tmp_path):
    """Experts, routers and the shared expert are packed; with the VNNI kernel the block runs as one C call
    (moe_native.py), which needs every projection on a kernel."""
    llm = LLM(str(write_tiny_moe(tmp_path / "moe")), dtype="bfloat16")
    model = llm.engine.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    for block in blocks:
        assert all(type(m) is PackedLinear for m in block.native_modules())
        assert not isinstance(block.native(), str) or vnni_kernel() is None
    assert isinstance(model.layers[0].self_attn.qkv_proj, PackedLinear)
    assert isinstance(model.lm_head, PackedLinear)


@needs_packing
def test_bf16_engine_packs_and_generates_what_an_eager_one_does(tiny_llama):
    """The same greedy tokens and top-2 logprobs within 0.02 nats (an allowance, not a derived bound): the
    packed kernels (AMX tiles or AVX512-BF16 pairs) and oneDNN's F.linear each sum in their own order, which
    on some CPUs and shapes differs by one bf16 rounding in a few elements (test_packed_linear_matches_f_linear
    holds each to the float32-summation bound). enforce_eager leaves the weights plain, fp32 is never packed."""
    packed = LLM(str(tiny_llama), dtype="bfloat16", decode_step="eager")  # layer by layer, so that:
    packed.engine.runner.attn_backend._kernel = None  # SDPA decode: the paged decode kernel rounds differently
    eager = LLM(str(tiny_llama), dtype="bfloat16", enforce_eager=True)
    fp32 = LLM(str(tiny_llama), dtype="float32")
    assert isinstance(packed.engine.model.layers[0].mlp.down_proj, PackedLinear)
    assert not any(isinstance(m, PackedLinear) for m in eager.engine.model.modules())
    assert not any(isinstance(m, PackedLinear) for m in fp32.engine.model.modules())
    g = torch.Generator().manual_seed(3)
    vocab = packed.engine.spec.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9, 12)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    for a, b in zip(packed.generate(prompts, params), eager.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for got, want in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert got.keys() == want.keys()
            assert all(abs(got[t] - want[t]) <= 0.02 for t in got), (got, want)


@needs_vnni
@pytest.mark.parametrize("path", ["vnni", "fma", "amx"])
@pytest.mark.parametrize(("n", "k", "group"), [(7, 64, 32), (130, 576, 64), (64, 256, 128), (100, 96, 96), (20, 48, 16)])
def test_int4_kernel_meets_the_float32_summation_bound_at_every_batch_shape(n, k, group, path, monkeypatch):
    """W4A16 on the VNNI panels (bf16_linear_int4). Up to the widening threshold (64 rows, 16 with `fma`; none on the
    AVX2 passes) nibbles are decoded exactly and each group is summed and folded in by its scale (in vdpbf16ps or,
    `fma`, in float32 FMAs): within the float32-summation bound of the exact product. Past it, and at every row
    count on AMX tiles (bf16_linear_int4_amx, forced here), each panel is dequantized once to bf16 (q - 8) * s,
    rounded as torch rounds that product (what transformers computes): within the same bound of that weight's
    product, and not of the exact one's. Rows that end mid-pass (3, 7,
    13), both pass shapes (vdpbf16ps: 1-3 rows over whole panels, 4-8 over half panels; `fma`: up to 5 over
    whole panels), mid AMX tile and work item (17,
    33), at and past the threshold (64, 65, 80) and outputs that are not a whole vector or panel. K = 48 is no
    multiple of an AMX tile's 32: that call keeps the VNNI path on every CPU."""
    from llmopt.layers.packed_linear import pack_int4_vnni

    kernel = vnni_kernel()
    if path == "amx" and not kernel.amx:
        pytest.skip("the CPU has no amx_bf16 (or Linux refused the AMX tile state)")
    monkeypatch.setitem(kernel.amx_min_rows, torch.uint8, 1 if path == "amx" else 10**9)
    monkeypatch.setattr(kernel, "fma", path == "fma")  # the passes in float32 FMAs, or vdpbf16ps
    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (n, k), generator=g)
    s = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(torch.bfloat16).float()
    w = (q.float() - 8) * s.repeat_interleave(group, 1)  # exact in float32 (a 4-bit code times a bf16 scale)
    w_bf16 = ((q - 8).to(torch.bfloat16) * s.to(torch.bfloat16).repeat_interleave(group, 1)).float()
    assert not torch.equal(w, w_bf16)  # the two references differ, so each check below can fail
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    packed, gscale = pack_int4_vnni(q, s)
    assert packed.numel() == (n + -n % 16) * k // 2 and gscale.numel() == k // group * (n + -n % 16)
    for rows in (1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 33, 64, 65, 80):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        got = kernel.int4(x, packed, gscale, group, bias, n)
        widened = rows > kernel.int4_widen_rows or kernel.uses_amx(rows, k, torch.uint8)
        ok, worst = within_bf16_linear_bound(got, x, w_bf16 if widened else w, bias)
        assert ok, f"{rows} rows ({path}): error {worst:.2f}x the bound"
        if widened and rows >= 4:  # the dequantized panels ran (1-3 rows: too few outputs to tell)
            assert not within_bf16_linear_bound(got, x, w, bias)[0], f"{rows} rows ({path})"


@needs_vnni
@pytest.mark.parametrize("fma", [False, True])
def test_the_fma_switch_picks_each_passes_own_summation_order(fma, monkeypatch):
    """x = (1, 0, 2^24, 1, -2^24, 0, 0, ...) against weights of 1 shows which passes ran, by where float32 drops
    a 1 next to 2^24: vdpbf16ps adds each pair's odd product, then its even one (1, 2, 2^24 + 2, 2); the int4
    FMA passes add in k order (1, 2^24, 2^24, 0); the int8 FMA passes sum even k (1, 2^24, 0) and odd k (1)
    apart and add them (1). So `fma` is not a no-op, whichever CPU runs it. The AVX2 passes (CPUs without
    AVX512-BF16) are float32 FMAs in k order for every storage, whatever the switch: int8 0; int4 sums the codes
    (9, 9, 9 * 2^24 + 16, 9 * 2^24 + 32, 32) and takes off 8 times the group's sum of x, summed in 8 lanes (2): 16."""
    from llmopt.layers.packed_linear import pack_int4_vnni

    kernel = vnni_kernel()
    monkeypatch.setitem(kernel.amx_min_rows, torch.uint8, 10**9)
    monkeypatch.setitem(kernel.amx_min_rows, torch.int8, 10**9)
    monkeypatch.setattr(kernel, "fma", fma)
    n, k = 16, 32
    x = torch.zeros(1, k)
    x[0, :6] = torch.tensor([1.0, 0.0, 2.0**24, 1.0, -(2.0**24), 0.0])
    x = x.to(torch.bfloat16)
    packed, gscale = pack_int4_vnni(torch.full((n, k), 9), torch.ones(n, 1))  # (9 - 8) * 1, one group
    int4 = kernel.int4(x, packed, gscale, k, None, n)
    int8 = kernel(x, pack_vnni(torch.ones(n, k, dtype=torch.int8)), None, n, torch.ones(n, dtype=torch.bfloat16))
    avx2 = kernel.isa == "avx2"
    assert torch.equal(int4.float(), torch.full((1, n), 16.0 if avx2 else 0.0 if fma else 2.0))
    assert torch.equal(int8.float(), torch.full((1, n), 0.0 if avx2 else 1.0 if fma else 2.0))


@pytest.fixture(scope="module")
def avx2_kernel(tmp_path_factory):
    """bf16_linear.c's AVX2 passes (`build_avx2`)."""
    from llmopt.layers.packed_linear import SOURCE, Bf16LinearKernel

    kernel = Bf16LinearKernel(build_avx2(SOURCE, tmp_path_factory.mktemp("avx2")))
    assert kernel.isa == "avx2" and kernel.available and not kernel.amx
    return kernel


@pytest.mark.parametrize(("n", "k", "group"), [(7, 34, 34), (64, 64, 32), (130, 576, 64), (200, 96, 96), (20, 48, 16)])
def test_avx2_passes_meet_the_float32_summation_bound(avx2_kernel, n, k, group):
    """bf16, int8 (per-output scales) and int4 (group scales) at row counts that end mid-pass (1-7 rows: 1 over the
    whole panel, 2 over half of it, more over a quarter, up to 6 or, int4, 3), mid work item (47-49) and past it,
    past a round of x's conversion to float32 (193, 250), with outputs that are not a whole vector, block or panel:
    within the bound of the exact product (every product is exact: no panel is dequantized at any row count). A row
    alone equals the same row in a batch, bitwise: its sums run in k order whatever the pass shape, and work items
    of 12 rows or more (the GEMM over float32 blocks) sum the same terms in the same order as the passes."""
    from llmopt.layers.packed_linear import pack_int4_vnni

    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s8 = (torch.rand(n, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    q4 = torch.randint(0, 16, (n, k), generator=g)
    s4 = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(torch.bfloat16).float()
    w4 = (q4.float() - 8) * s4.repeat_interleave(group, 1)  # exact: a 4-bit code times a bf16 scale
    p4, gs4 = pack_int4_vnni(q4, s4)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    pw, p8 = pack_vnni(w), pack_vnni(q8)
    calls = {"bf16": (lambda x: avx2_kernel(x, pw, bias, n), w, None),
             "int8": (lambda x: avx2_kernel(x, p8, bias, n, s8), q8, s8),
             "int4": (lambda x: avx2_kernel.int4(x, p4, gs4, group, bias, n), w4, None)}
    x_all = torch.randn(250, k, generator=g).to(torch.bfloat16)  # past 192 rows x is converted in rounds
    for storage, (call, weight, scale) in calls.items():
        batched = call(x_all)
        for rows in (1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 47, 48, 49, 60, 100, 193, 250):
            got = call(x_all[:rows])
            ok, worst = within_bf16_linear_bound(got, x_all[:rows], weight, bias, scale)
            assert ok, f"{storage}, {rows} rows: error {worst:.2f}x the bound"
            assert torch.equal(got, batched[:rows]), f"{storage}, {rows} rows"
        for i in (0, 5, 49, 99, 249):
            assert torch.equal(call(x_all[i:i + 1]), batched[i:i + 1]), f"{storage}, row {i}"
        threads = torch.get_num_threads()
        try:  # each thread takes a run of (16 outputs x a row chunk) units, which may start and end mid-panel
            for nt in (1, 3, 5):
                torch.set_num_threads(nt)
                for rows in (1, 2, 7, 13, 48, 49, 100):
                    assert torch.equal(call(x_all[:rows]), batched[:rows]), f"{storage}, {rows} rows, {nt} threads"
        finally:
            torch.set_num_threads(threads)
