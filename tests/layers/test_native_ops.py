"""The C element-wise kernels (`llmopt.layers.native_ops`) against the eager functions they replace, the
input they leave to eager torch, the fallback without a compiler, and the engine's decode steps on them."""

from __future__ import annotations

import pytest
import torch

from llmopt import LLM, SamplingParams
from llmopt.layers import kernels, native_ops
from llmopt.layers.activation import gelu_tanh_and_mul, silu_and_mul
from llmopt.layers.kernels import Ops
from llmopt.layers.norm import add_offset_rms_norm, add_rms_norm, offset_rms_norm, rms_norm
from llmopt.layers.rotary import RotaryEmbedding, apply_rotary


@pytest.fixture(scope="module")
def ops():
    lib = native_ops.load()
    if lib is None:
        pytest.skip("no C compiler here")
    return lib


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (same-sign values; bf16 bit patterns are ordered)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ia - ib).abs()


def assert_matches(got, want, max_ulps: int, exact: float, atol: float = 0.0):
    """Every element within `max_ulps` bf16 ulps (or `atol`), and at least a share `exact` identical."""
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                    strict=True):
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
        d = _ulps(a, b)
        far = (d > max_ulps) & ((a.float() - b.float()).abs() > atol)
        assert not far.any(), (a[far][:5], b[far][:5])
        assert float((d == 0).float().mean()) >= exact


ROWS = [1, 3, 63, 200]  # 200 x 576 crosses the size where the kernels use every thread


@pytest.mark.parametrize("rows", ROWS)
def test_norms_match_eager(ops, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).bfloat16()
    r = torch.randn(rows, 576, generator=g).bfloat16()
    w = (torch.rand(576, generator=g) + 0.5).bfloat16()
    for fn, args in [(rms_norm, (x, w, 1e-5)), (add_rms_norm, (x, r, w, 1e-5)),
                     (offset_rms_norm, (x, w, 1e-6)), (add_offset_rms_norm, (x, r, w, 1e-6))]:
        assert_matches(getattr(ops, fn.__name__)(*args), fn(*args), max_ulps=1, exact=0.999)


def test_norm_reads_rows_of_a_wider_tensor(ops):
    """A norm input may be a column slice of a bigger tensor (rows further apart than their length)."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(5, 100, generator=g).bfloat16()
    x, w = wide[:, 10:74], torch.rand(64, generator=g).bfloat16()
    assert x.stride(0) == 100
    assert_matches(ops.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), max_ulps=1, exact=0.999)


@pytest.mark.parametrize("rows", ROWS)
def test_rotary_matches_eager_on_a_view_of_the_fused_qkv(ops, rows):
    g = torch.Generator().manual_seed(rows)
    rope = RotaryEmbedding(64, 4096, 10000.0, None)
    qkv = torch.randn(rows, 15 * 64, generator=g).bfloat16()  # q 9 heads | k 3 | v 3
    qk = qkv[:, :12 * 64].view(rows, 12, 64)
    cos, sin = rope(torch.randint(0, 4096, (rows,), generator=g))
    got = ops.apply_rotary(qk, cos, sin)
    assert got.is_contiguous()
    assert_matches(got, apply_rotary(qk, cos, sin), max_ulps=1, exact=0.999)


@pytest.mark.parametrize("rows", ROWS)
def test_gated_activations_match_eager(ops, rows):
    """SiLU·up and GELU-tanh·up differ from torch's by the last-bit rounding of exp / tanh (one ulp in the
    bf16 activation, up to two in its product with up); far out on
    GELU's negative tail, 1 + tanh cancels and both are within 1e-4 of 0 (outputs here reach ~30)."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 1536, generator=g) * 4).bfloat16()
    assert_matches(ops.silu_and_mul(x, 1536), silu_and_mul(x, 1536), max_ulps=2, exact=0.99)
    assert_matches(ops.gelu_tanh_and_mul(x, 1536), gelu_tanh_and_mul(x, 1536), max_ulps=2, exact=0.95,
                   atol=1e-4)


def test_gated_activations_of_extreme_gates_match_eager(ops):
    """Gates whose exp overflows, infinite and NaN gates, and a width that leaves a partial vector: SiLU·up and
    GELU·up give eager's zeros (of the gate's sign), infinities and NaNs where eager does, and its values elsewhere."""
    gates = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-38, -1e-38, 88.0, -88.0, 89.0, -89.0, 100.0,
             -100.0, 3e38, -3e38, 1.0, 2.0, -3.0, -5.0, 9.0, 11.0]  # 21: one vector of 16 and a partial one
    x = torch.tensor([gates + [1.0] * len(gates)]).bfloat16()
    for native, eager in ((ops.silu_and_mul, silu_and_mul), (ops.gelu_tanh_and_mul, gelu_tanh_and_mul)):
        got, want = native(x, len(gates)), eager(x, len(gates))
        assert torch.equal(got.isnan(), want.isnan()), (got, want)
        ok = ~want.isnan()
        assert torch.equal(got[ok].float().signbit(), want[ok].float().signbit()), (got, want)
        assert_matches(got[ok], want[ok], max_ulps=2, exact=0.9)


def test_input_it_does_not_take_is_left_to_eager(ops):
    """Not bf16, not a row layout it reads, or mismatched shapes: None, and `kernels.call` runs eager."""
    x, w = torch.randn(4, 32), torch.ones(32)
    assert ops.rms_norm(x, w, 1e-6) is None  # float32
    assert ops.rms_norm(x.half(), w.half(), 1e-6) is None
    xb, wb = x.bfloat16(), w.bfloat16()
    assert ops.rms_norm(xb.t().contiguous().t(), wb, 1e-6) is None  # columns not contiguous
    assert ops.rms_norm(xb.view(4, 2, 16), wb[:16], 1e-6) is None  # per-head q/k norms: [T, H, D]
    assert ops.rms_norm(xb, wb[:16], 1e-6) is None
    assert ops.add_rms_norm(xb, xb[:2], wb, 1e-6) is None
    assert ops.silu_and_mul(xb, 8) is None  # not gate | up of that size
    qk = torch.randn(3, 4, 8).bfloat16()
    cos = torch.randn(3, 1, 8)
    assert ops.apply_rotary(qk.transpose(0, 1), cos, cos) is None  # heads not contiguous
    assert ops.apply_rotary(qk, cos.bfloat16(), cos.bfloat16()) is None
    for fn, args in [(rms_norm, (x, w, 1e-6)), (rms_norm, (xb.view(4, 2, 16), wb[:16], 1e-6))]:
        assert torch.equal(kernels.call(Ops.NATIVE, fn, *args), fn(*args))


def test_only_declared_functions_run_native(ops):
    """A function is replaced only when its definition declares a native version, never by its name."""

    def rms_norm(x, weight, eps):  # same name and signature, other semantics
        return x * 2

    x, w = torch.randn(3, 32).bfloat16(), torch.rand(32).bfloat16()
    assert torch.equal(kernels.call(Ops.NATIVE, rms_norm, x, w, 1e-6), x * 2)


def test_without_a_compiler_native_steps_run_eager(no_compiler, caplog):
    x, w = torch.randn(3, 32).bfloat16(), torch.rand(32).bfloat16()
    with caplog.at_level("WARNING", logger="llmopt.native"):
        out = kernels.call(Ops.NATIVE, rms_norm, x, w, 1e-6)
    assert torch.equal(out, rms_norm(x, w, 1e-6))
    assert native_ops.load() is None
    assert "native ops kernel unavailable" in caplog.text and "eager torch" in caplog.text


def test_bf16_engine_decodes_on_native_ops(ops, tiny_llama):
    """Decode steps of a bf16 engine run Ops.NATIVE (prefills of 64+ tokens COMPILED, fp32 always EAGER),
    and its greedy tokens and logprobs agree with an enforce_eager engine's."""
    fast = LLM(str(tiny_llama), dtype="bfloat16")
    eager = LLM(str(tiny_llama), dtype="bfloat16", enforce_eager=True)
    seen = []
    real_prepare = fast.engine.runner.prepare

    def prepare(scheduled):
        out = real_prepare(scheduled)
        seen.append(out.attn_metadata.ops)
        return out

    fast.engine.runner.prepare = prepare
    g = torch.Generator().manual_seed(3)
    vocab = fast.engine.spec.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 20, 70)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    got, want = fast.generate(prompts, params), eager.generate(prompts, params)
    assert Ops.NATIVE in seen and Ops.COMPILED in seen
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids, strict=True):
            assert abs(la[t] - lb[t]) < 0.05
    assert eager.engine.runner.attn_backend.choose_ops(torch.bfloat16, 1) is Ops.EAGER
