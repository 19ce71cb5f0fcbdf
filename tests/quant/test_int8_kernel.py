"""The int8 weight-only decode kernel on its own (against a float reference, for the shapes, row counts,
dtypes and thread counts the engine sends it), inside `Int8WeightOnlyLinear` (kernel, torch's kernel and
the dequantized path agree), the fallback when it cannot be built, and a W8A16 engine through it."""

from __future__ import annotations

import logging

import pytest
import torch
from _qhelpers import rel_err

from llmopt.errors import LlmoptError
from llmopt.quant import Int8WeightOnlyLinear, QuantScheme, rtn_quantize
from llmopt.quant import int8_kernel as ik
from llmopt.quant.linear import use_native_int8_kernel
from tests.conftest import needs_cc


def _reference(x, w, s):
    return (x.double() @ w.double().t()) * s.double()


@needs_cc
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(1, 16), (7, 35), (64, 64), (13, 96), (96, 576), (5, 1000)])
def test_kernel_matches_a_float_reference(n, k, dtype, threads):
    """Every row count from 1 to 9 (and 17, 64): the 4x4 register blocks, their partial edges, K tails
    past the 32-wide dot products, and N not a multiple of the 4-row blocks. bf16 output is within one
    rounding of the exact result; float32 output within float32 summation error."""
    kernel = ik.load()
    assert kernel is not None
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s = (torch.rand(n, generator=g) / 50 + 1e-3).to(dtype)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in [*range(1, 10), 17, 64]:
            x = torch.randn(m, k, generator=g).to(dtype)
            y = kernel(x, w, s)
            assert y.shape == (m, n) and y.dtype == dtype
            ref = _reference(x, w, s)
            tol = 2 ** -8 if dtype == torch.bfloat16 else 1e-5
            assert ((y.double() - ref).abs() <= tol * ref.abs() + 1e-4 * ref.abs().max()).all(), (m, dtype)
    finally:
        torch.set_num_threads(prev)


@needs_cc
def test_kernel_reads_strided_activations_and_extreme_weights():
    """A non-contiguous x (a column slice) is copied, not misread; weights at -128 and 127 are exact."""
    kernel = ik.load()
    w = torch.tensor([[-128] * 40, [127] * 40], dtype=torch.int8)
    s = torch.tensor([0.5, 0.25], dtype=torch.bfloat16)
    x = torch.ones(3, 80, dtype=torch.bfloat16)[:, ::2]
    assert not x.is_contiguous()
    assert kernel(x, w, s).tolist() == [[-2560.0, 1272.0]] * 3  # 1270 rounded to bf16 (steps of 8 there)
    assert kernel(x.float(), w, s.float()).tolist() == [[-2560.0, 1270.0]] * 3


@needs_cc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_is_torchs_multiply(dtype):
    """The weight bigger batches multiply by is bitwise torch's `int8 * scale` (one rounding per element)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randint(-128, 128, (37, 101), generator=g, dtype=torch.int8)
    s = (torch.rand(37, generator=g) / 50).to(dtype)
    got = ik.load().dequantize(w, s)
    assert got.dtype == dtype and torch.equal(got, torch.mul(w, s[:, None]))
    with pytest.raises(ValueError):
        ik.load().dequantize(w.t(), s)
    with pytest.raises(ValueError):
        ik.load().dequantize(w, s[:-1])


@needs_cc
def test_kernel_refuses_mismatched_shapes():
    """The C code trusts its shapes, so the wrapper checks them: a one-line error, not a wild read."""
    w = torch.zeros(8, 32, dtype=torch.int8)
    s = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="int8 kernel"):
        ik.load()(torch.zeros(1, 16, dtype=torch.bfloat16), w, s)
    with pytest.raises(ValueError, match="int8 kernel"):
        ik.load()(torch.zeros(1, 32, dtype=torch.bfloat16), w, s[:4])


@needs_cc
@pytest.mark.parametrize("symmetric", [True, False])
def test_linear_paths_agree(symmetric):
    """Per-channel int8 on a CPU: decode-size batches on our kernel, on torch's `_weight_int8pack_mm`
    (kernel off), and big batches on the dequantized weight all match the dequantized reference."""
    w = torch.randn(96, 256) * 0.05
    qw = rtn_quantize(w, QuantScheme(bits=8, group_size=-1, symmetric=symmetric))
    m = Int8WeightOnlyLinear.from_quantized(qw, torch.randn(96))
    assert m.mode == "cpu-int8"
    ref_w = qw.dequantize()
    for rows in (1, 3, 8, ik.MAX_ROWS, ik.MAX_ROWS + 1, 200):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), ref_w, m.bias.float())
        ours = m(x)
        m.native_kernel = False
        theirs = m(x)
        m.native_kernel = True
        assert rel_err(ours, ref) < 1e-2 and rel_err(theirs, ref) < 1e-2, rows
        if rows <= ik.MAX_ROWS:
            assert rel_err(ours, theirs) < 1e-2
        else:  # past MAX_ROWS both dequantize (ours in C, else torch) to the same weight, then one matmul
            assert torch.equal(ours, theirs)


def test_failed_build_falls_back_to_torch(no_compiler, caplog):
    """No working compiler: one warning, and int8 matmuls run (and are right) on torch's kernel, big
    batches on torch's own dequantization."""
    with caplog.at_level(logging.WARNING):
        assert ik.load() is None
        assert ik.load() is None
    assert caplog.text.count("int8 linear kernel unavailable") == 1
    qw = rtn_quantize(torch.randn(32, 64) * 0.05, QuantScheme(bits=8, group_size=-1))
    m = Int8WeightOnlyLinear.from_quantized(qw)
    for rows in (2, ik.MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        assert rel_err(m(x), torch.nn.functional.linear(x, qw.dequantize())) < 1e-2
    assert not list(no_compiler.glob("kernels/*.so"))


@needs_cc
def test_w8a16_engine_decodes_through_the_kernel(tiny_llama, tmp_path, monkeypatch):
    """A bf16 W8A16 engine decodes through our kernel (the int8 weights in VNNI pairs where the CPU has
    AVX512-BF16, else `int8_linear.c`) and agrees with an enforce_eager one (torch's int8 kernel): the
    same greedy tokens, logprobs within a few hundredths."""
    from llmopt import LLM, SamplingParams
    from llmopt.layers.packed_linear import Bf16LinearKernel, vnni_kernel
    from llmopt.quant.packed_int8 import PackedInt8Linear
    from llmopt.quant.pipeline import quantize_model
    from llmopt.quant.recipe import QuantizeConfig

    out = tmp_path / "w8"
    quantize_model(QuantizeConfig(model=str(tiny_llama), scheme="w8a16", output=out, device="cpu"))
    fast = LLM(str(out), dtype="bfloat16")
    eager = LLM(str(out), dtype="bfloat16", enforce_eager=True)
    eager_mods = [m for m in eager.engine.runner.model.modules() if isinstance(m, Int8WeightOnlyLinear)]
    assert eager_mods and not any(m.native_kernel for m in eager_mods)  # enforce_eager
    assert use_native_int8_kernel(eager.engine.runner.model, False) == len(eager_mods)
    if vnni_kernel() is not None:
        mods = [m for m in fast.engine.runner.model.modules() if isinstance(m, PackedInt8Linear)]
        assert not any(isinstance(m, Int8WeightOnlyLinear) for m in fast.engine.runner.model.modules())
        kernel_cls = Bf16LinearKernel
    else:
        mods = [m for m in fast.engine.runner.model.modules() if isinstance(m, Int8WeightOnlyLinear)]
        assert all(m.native_kernel and m.mode == "cpu-int8" for m in mods)
        kernel_cls = ik.Int8LinearKernel
    assert len(mods) == len(eager_mods)
    calls = []  # counts the real kernel's calls (it still runs)
    real = kernel_cls.__call__
    monkeypatch.setattr(kernel_cls, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    g = torch.Generator().manual_seed(3)
    vocab = fast.engine.spec.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 40, 70)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    got = fast.generate(prompts, params)
    n_fast = len(calls)
    want = eager.generate(prompts, params)
    assert n_fast > 0 and len(calls) == n_fast  # the eager engine never called it
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids, strict=True):
            assert abs(la[t] - lb[t]) < 0.05


@needs_cc
def test_decode_batches_go_straight_to_the_kernel_and_the_rest_does_not(monkeypatch):
    """A module built for the kernel (per-channel, no bias or zero point) hands contiguous decode-size
    batches to it directly; other input takes the general path, with its checks."""
    w = torch.randn(48, 64) * 0.05
    m = Int8WeightOnlyLinear.from_quantized(rtn_quantize(w, QuantScheme(bits=8, group_size=-1, symmetric=True)),
                                            compute_dtype=torch.bfloat16)
    asym = Int8WeightOnlyLinear.from_quantized(rtn_quantize(w, QuantScheme(bits=8, group_size=-1, symmetric=False)),
                                               compute_dtype=torch.bfloat16)
    calls = []
    real = ik.Int8LinearKernel.__call__
    monkeypatch.setattr(ik.Int8LinearKernel, "__call__", lambda self, x, *a: calls.append(tuple(x.shape)) or real(self, x, *a))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(m(x), real(ik.load(), x, m.weight, m.scales)) and calls == [(3, 64)]
    calls.clear()
    assert m(x.unsqueeze(0)).shape == (1, 3, 48) and calls == [(3, 64)]  # 3-D: reshaped by the general path
    calls.clear()
    wide = torch.randn(3, 128, dtype=torch.bfloat16)
    assert torch.equal(m(wide[:, ::2]), m(wide[:, ::2].contiguous()))  # strided: general path, same result
    asym(x)
    assert m._decode_kernel and asym._decode_kernel is False  # a zero point needs the general path's correction
    with pytest.raises(LlmoptError, match="was packed for cpu"):
        m(torch.empty(2, 64, dtype=torch.bfloat16, device="meta"))
    m.native_kernel = False  # enforce_eager: resolved again, to none
    calls.clear()
    m(x)
    assert calls == [] and m._decode_kernel is False
