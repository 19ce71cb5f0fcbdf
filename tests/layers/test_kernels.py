"""The TorchInductor-compiled layer functions against their eager definitions and SDPA, and when the
engine uses them (big bf16 CPU steps only; never fp32, never with enforce_eager)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmopt import LLM, SamplingParams
from llmopt.layers import kernels
from llmopt.layers.activation import gelu_tanh_and_mul, silu_and_mul
from llmopt.layers.attention.head_major import causal_attention
from llmopt.layers.kernels import Ops
from llmopt.layers.norm import add_rms_norm, rms_norm
from llmopt.layers.rotary import apply_rotary


def _sdpa(q, k, v, scale, offset):
    """Reference: SDPA with K/V heads repeated and an explicit causal mask offset by `offset`."""
    length, h, _ = q.shape
    rep = h // k.shape[0]
    kk, vv = k.repeat_interleave(rep, 0).float(), v.repeat_interleave(rep, 0).float()
    allowed = torch.arange(k.shape[1])[None, :] <= (torch.arange(length)[:, None] + offset)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).float(), kk, vv, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1).reshape(length, -1)


@pytest.mark.parametrize("offset", [0, 37])
def test_causal_attention_matches_sdpa(offset):
    g = torch.Generator().manual_seed(offset)
    length, h, hkv, d = 70, 6, 2, 16
    q = torch.randn(length, h, d, generator=g)
    k, v = torch.randn(hkv, offset + length, d, generator=g), torch.randn(hkv, offset + length, d, generator=g)
    ref = _sdpa(q, k, v, d**-0.5, offset)
    assert torch.allclose(causal_attention(q, k, v, d**-0.5, offset), ref, atol=1e-5)
    out = kernels.call(Ops.COMPILED, causal_attention, q.bfloat16(), k.bfloat16(), v.bfloat16(), d**-0.5, offset)
    assert causal_attention in kernels._compiled, kernels._broken
    assert torch.allclose(out.float(), ref, atol=3e-2)


def test_compiled_elementwise_functions_match_eager(monkeypatch):
    monkeypatch.setattr(kernels, "_native_below", {})  # inductor's versions even where native ones run instead
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 32, generator=g).bfloat16()
    r = torch.randn(96, 32, generator=g).bfloat16()
    w = torch.rand(32, generator=g).bfloat16()
    qk = torch.randn(96, 5, 8, generator=g).bfloat16()
    cos, sin = torch.randn(96, 1, 8, generator=g), torch.randn(96, 1, 8, generator=g)
    gate_up = torch.randn(96, 64, generator=g).bfloat16()
    cases = [(rms_norm, (x, w, 1e-5)), (add_rms_norm, (x, r, w, 1e-5)), (apply_rotary, (qk, cos, sin)),
             (silu_and_mul, (gate_up, 32))]
    for fn, args in cases:
        got, want = kernels.call(Ops.COMPILED, fn, *args), fn(*args)
        assert fn in kernels._compiled, kernels._broken
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                        strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.allclose(a.float(), b.float(), atol=3e-2, rtol=2e-2), fn.__name__


def test_compiled_steps_run_the_native_versions_where_those_are_faster(monkeypatch):
    """In a compiled step, RoPE and GELU·up run native at every size, the norms and SiLU·up under
    NATIVE_PREFILL_ROWS rows (the norms' and RoPE's results bitwise the eager ones); from there on, and for input
    a native version declines (fp16), inductor's."""
    monkeypatch.setattr(kernels, "_compiled", {})
    g = torch.Generator().manual_seed(1)
    small, big = 96, kernels.NATIVE_PREFILL_ROWS
    x, w = torch.randn(big, 32, generator=g).bfloat16(), torch.rand(32, generator=g).bfloat16()
    qk = torch.randn(big, 5, 8, generator=g).bfloat16()
    cos, sin = torch.randn(big, 1, 8, generator=g), torch.randn(big, 1, 8, generator=g)
    for fn, args in ((rms_norm, (x[:small], w, 1e-5)), (apply_rotary, (qk, cos, sin))):
        assert torch.equal(kernels.call(Ops.COMPILED, fn, *args), fn(*args)), fn.__name__
        assert fn not in kernels._compiled, fn.__name__
    kernels.call(Ops.COMPILED, rms_norm, x, w, 1e-5)
    assert rms_norm in kernels._compiled, kernels._broken
    kernels.call(Ops.COMPILED, silu_and_mul, torch.randn(small, 64, generator=g).bfloat16(), 32)
    assert silu_and_mul not in kernels._compiled
    kernels.call(Ops.COMPILED, silu_and_mul, torch.randn(big, 64, generator=g).bfloat16(), 32)
    assert silu_and_mul in kernels._compiled, kernels._broken
    kernels.call(Ops.COMPILED, gelu_tanh_and_mul, torch.randn(big, 64, generator=g).bfloat16(), 32)
    assert gelu_tanh_and_mul not in kernels._compiled  # native at every size
    got = kernels.call(Ops.COMPILED, add_rms_norm, x[:small].half(), x[:small].half(), w.half(), 1e-5)
    assert add_rms_norm in kernels._compiled and got[0].dtype == torch.float16, kernels._broken


def test_each_step_size_and_dtype_gets_its_implementation():
    cpu = torch.device("cpu")
    assert kernels.choose(torch.bfloat16, cpu, kernels.MIN_TOKENS) is Ops.COMPILED
    assert kernels.choose(torch.float16, cpu, kernels.MIN_TOKENS) is Ops.COMPILED
    assert kernels.choose(torch.bfloat16, cpu, kernels.MIN_TOKENS - 1) is Ops.NATIVE
    assert kernels.choose(torch.float16, cpu, 1) is Ops.EAGER  # the C kernels are bf16 only
    assert kernels.choose(torch.float32, cpu, 1) is Ops.EAGER
    assert kernels.choose(torch.float32, cpu, 4096) is Ops.EAGER
    assert kernels.choose(torch.bfloat16, torch.device("cuda"), 4096) is Ops.EAGER
    assert kernels.choose(torch.bfloat16, torch.device("cuda"), 1) is Ops.EAGER


def test_prefill_attention_widens_16_bit_and_takes_sdpa_only_where_the_cpu_has_no_matmul_for_it(monkeypatch):
    from llmopt.layers.attention import head_major

    cpu = torch.device("cpu")
    assert head_major.prefill_dtype(torch.float32, cpu) == torch.float32
    assert head_major.prefill_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(head_major, "onednn_supported", lambda dtype: False)
    assert head_major.prefill_dtype(torch.bfloat16, cpu) == torch.float32
    assert head_major.compiled_attention_max_scores(cpu) == 0  # SDPA at every size there (measured on Zen 3)
    monkeypatch.setattr(head_major, "onednn_supported", lambda dtype: True)
    assert head_major.prefill_dtype(torch.bfloat16, cpu) == torch.bfloat16
    amx = head_major.native.cpu_has("amx_bf16")
    assert head_major.compiled_attention_max_scores(cpu) == (0 if amx else head_major.COMPILED_ATTENTION_MAX_SCORES)
    assert head_major.compiled_attention_max_scores(torch.device("cuda")) == head_major.COMPILED_ATTENTION_MAX_SCORES


@pytest.mark.parametrize("widen", [False, True])
def test_engine_bf16_prefill_compiled_agrees_with_eager(tiny_llama, widen, monkeypatch):
    """A bf16 engine runs its big prefill steps compiled (and says so per step); its first tokens and
    their logprobs agree with an enforce_eager engine's, with prefill attention in bf16 and in float32 (what CPUs
    without a bf16 matmul run: both paths on every CPU)."""
    from llmopt.layers.attention import head_major

    monkeypatch.setattr(head_major, "onednn_supported", lambda dtype: not widen)
    compiled = LLM(str(tiny_llama), dtype="bfloat16")
    eager = LLM(str(tiny_llama), dtype="bfloat16", enforce_eager=True)
    assert compiled.engine.runner.attn_backend.allow_compiled and not eager.engine.runner.attn_backend.allow_compiled
    g = torch.Generator().manual_seed(5)
    vocab = compiled.engine.spec.vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(40, 120, (8,), generator=g)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=1)
    seen = []
    real_prepare = compiled.engine.runner.prepare

    def prepare(scheduled):
        out = real_prepare(scheduled)
        seen.append(out.attn_metadata.ops is Ops.COMPILED)
        return out

    compiled.engine.runner.prepare = prepare
    a = compiled.generate(prompts, params)
    b = eager.generate(prompts, params)
    assert any(seen)
    same = 0
    for x, y in zip(a, b, strict=True):
        tx, ty = x.outputs[0].token_ids[0], y.outputs[0].token_ids[0]
        same += tx == ty
        lx, ly = x.outputs[0].logprobs[0][tx], y.outputs[0].logprobs[0][tx] if tx in y.outputs[0].logprobs[0] else None
        if ly is not None:
            assert abs(lx - ly) < 0.1
    assert same >= 6


def test_a_failed_compile_falls_back_to_eager_and_says_so(monkeypatch, caplog):
    """Without a working C++ compiler TorchInductor cannot build CPU kernels: the call still returns the
    eager result, a warning names the failure, and later calls stay eager."""
    import torch._inductor.config as inductor_config

    # torch's own config.patch, not monkeypatch: monkeypatch's undo deletes the key from torch's config
    # module (its getattr hook makes the attribute look new), and every later compile then fails
    monkeypatch.setattr(kernels, "_broken", [])
    monkeypatch.setattr(kernels, "_compiled", {})

    def scaled_tanh(x, s: float):  # a graph no cache holds yet
        return torch.tanh(x * s) + 0.123456

    x = torch.randn(80, 8)
    torch._dynamo.reset()
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",)}), \
            caplog.at_level("WARNING", logger="llmopt.layers.kernels"):
        out = kernels.call(Ops.COMPILED, scaled_tanh, x, 1.5)
    torch._dynamo.reset()
    assert inductor_config.cpp.cxx != ("/nonexistent/c++",)  # restored for the tests that follow
    assert torch.equal(out, scaled_tanh(x, 1.5))
    assert not kernels.available()
    assert "compiled kernels unavailable" in caplog.text
