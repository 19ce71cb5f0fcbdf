"""The native decode step (llmopt.step): every family it lowers and every feature around a decode step
gives greedy tokens identical to the eager step (`decode_step="eager"`), the native call really runs
(counted), and what it does not take runs eagerly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from llmopt import LLM, SamplingParams
from llmopt.layers.linear import set_submodule
from llmopt.layers.packed_linear import PackedLinear, vnni_kernel
from llmopt.quant.rows import ConcatLinear
from llmopt.step import DecodeStep
from llmopt.step.program import OP_ATTEND, OP_COPY_COLS, OP_KV_WRITE, OP_LINEAR, OP_MOE
from tests.engine_utils import token_ids
from tests.models.families import (  # noqa: F401
    WINDOW,
    tiny_gemma3,
    tiny_mistral_sw,
    tiny_mixtral,
    tiny_qwen2_moe,
    tiny_qwen3,
    tiny_qwen3_mixed,
    tiny_qwen3_moe,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
from _pipeline_helpers import calib_options, quantize_tiny  # noqa: E402

pytestmark = pytest.mark.skipif(vnni_kernel() is None, reason="no AVX512-BF16 here: bf16 steps run eagerly")

# 20 sequences of 3-90 prompt tokens: decode groups of different context lengths, batch sizes that shrink
# as sequences finish at different lengths, and contexts past the sliding window of the windowed families
PROMPTS = [[3 + (7 * i + j) % 400 for j in range(3 + (i * 29) % 88)] for i in range(20)]


@pytest.fixture
def native_calls(monkeypatch) -> list[int]:
    """The row count of every native step that runs (a spy around the real call)."""
    calls: list[int] = []
    real = DecodeStep.__call__

    def spy(self, input_ids, *args, **kwargs):
        calls.append(input_ids.shape[0])
        return real(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(DecodeStep, "__call__", spy)
    return calls


def _both(model_dir, prompts=PROMPTS, max_tokens=(6, 30), **engine) -> tuple[list, list]:
    """Greedy tokens with the eager and the native step (each prompt gets its own max_tokens)."""
    params = [SamplingParams(temperature=0, max_tokens=max_tokens[0] + i % max_tokens[1], ignore_eos=True)
              for i in range(len(prompts))]
    out = []
    for mode in ("eager", "native"):
        llm = LLM(str(model_dir), dtype="bfloat16", device="cpu", num_kv_blocks=256, decode_step=mode, **engine)
        assert (llm.engine.runner.decode_step is not None) == (mode == "native")
        out.append(token_ids(llm, prompts, params))
    return out[0], out[1]


MOE = ["tiny_qwen3_moe", "tiny_mixtral", "tiny_qwen2_moe"]


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_mistral_sw", "tiny_qwen3_mixed",
                                    "tiny_gemma3", *MOE])
def test_greedy_tokens_identical_to_the_eager_step(family, request, native_calls):
    model_dir = request.getfixturevalue(family)
    eager, native = _both(model_dir)
    assert native == eager
    assert len(native_calls) > 20 and max(native_calls) == len(PROMPTS) and min(native_calls) == 1
    if family in ("tiny_mistral_sw", "tiny_qwen3_mixed", "tiny_gemma3"):
        assert max(len(p) for p in PROMPTS) > 2 * WINDOW


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3", "tiny_gemma3", "tiny_qwen3_moe"])
def test_big_decode_batches_identical(family, request, native_calls):
    """Decode steps of 64 rows and more (max_num_seqs past the default 64) run in the step too, up to its
    `max_rows` (fewer where q/k norms per head would take the eager step's compiled norm), with tokens and
    logprobs bit for bit the eager step's; bigger ones run eagerly."""
    prompts = [[3 + (5 * i + j) % 300 for j in range(2 + i % 9)] for i in range(150)]
    params = [SamplingParams(temperature=0, max_tokens=3 + i % 10, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    out = []
    for mode in ("eager", "native"):
        llm = LLM(str(request.getfixturevalue(family)), dtype="bfloat16", device="cpu", num_kv_blocks=512,
                  max_num_seqs=200, decode_step=mode)
        res = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        out.append([(c.token_ids, [sorted(lp.items()) for lp in c.logprobs]) for c in res])
    assert out[0] == out[1]
    step = llm.engine.runner.decode_step
    assert step.max_rows == (127 if family != "tiny_llama" else 511)  # 4 query heads: 511 // 4
    assert 63 < max(native_calls) <= min(step.max_rows, len(prompts))


@pytest.mark.parametrize("family", MOE)
def test_moe_blocks_are_one_op(family, request):
    """Each sparse block is one MOE op (router, experts and the shared expert in C); dense layers stay linears."""
    llm = LLM(str(request.getfixturevalue(family)), dtype="bfloat16", device="cpu", num_kv_blocks=64)
    model = llm.engine.model
    sparse = sum(type(layer.mlp).__name__ == "SparseMoeBlock" for layer in model.layers)
    ops = llm.engine.runner.decode_step.program.ops
    assert 0 < sparse < len(model.layers) or family == "tiny_mixtral"
    assert sum(op.kind == OP_MOE for op in ops) == sparse
    # per layer: q|k|v and o; a dense layer adds gate|up and down
    assert sum(op.kind == OP_LINEAR for op in ops) == 2 * len(model.layers) + 2 * (len(model.layers) - sparse)


@pytest.mark.parametrize("scheme", ["w8a16", "w4a16"])
def test_quantized_experts_identical(scheme, tiny_qwen2_moe, tmp_path, monkeypatch, native_calls):  # noqa: F811
    """Quantized experts (and the shared expert) run their own kernels inside the MoE op; routers stay bf16."""
    quantize_tiny(monkeypatch, tiny_qwen2_moe, tmp_path / "q", scheme=scheme,
                  **({"group_size": 32} if scheme == "w4a16" else {}))
    eager, native = _both(tmp_path / "q", prompts=PROMPTS[:6])
    assert native == eager and native_calls
    llm = LLM(str(tmp_path / "q"), dtype="bfloat16", device="cpu", num_kv_blocks=64)
    block = next(layer.mlp for layer in llm.engine.model.layers if type(layer.mlp).__name__ == "SparseMoeBlock")
    spec = block.native().spec
    want = 1 if scheme == "w8a16" else 2
    assert {spec.experts[i].storage for i in range(2 * block.num_experts)} == {want}
    assert spec.shared_gate_up.storage == spec.shared_down.storage == want
    assert spec.router.storage == spec.shared_gate.storage == 0


@pytest.mark.parametrize("case", ["w8a16", "w4a16", "w4a16-gptq-act-order"])
def test_quantized_projections_identical(case, tiny_llama, tmp_path, monkeypatch, native_calls):
    scheme = case.split("-")[0]
    # act-order with a group index (GPTQ format): the kernel reads x's columns permuted
    extra = ({"method": "gptq", "act_order": True, "static_groups": False, "format": "gptq", **calib_options()}
             if "gptq" in case else {})
    if scheme == "w4a16":
        extra["group_size"] = 32  # w8a16: per channel, the scheme our int8 kernel runs
    quantize_tiny(monkeypatch, tiny_llama, tmp_path / "q", scheme=scheme, **extra)
    eager, native = _both(tmp_path / "q", prompts=PROMPTS[:6])
    assert native == eager and native_calls
    step = LLM(str(tmp_path / "q"), dtype="bfloat16", device="cpu", num_kv_blocks=64).engine.runner.decode_step
    kinds = {op.i[0] for op in step.program.ops if op.kind == 2}  # OP_LINEAR's storage
    assert kinds == {1 if scheme == "w8a16" else 2}  # every decoder projection quantized, on its kernel
    if "act-order" in case:
        assert any(op.kind == 3 for op in step.program.ops)  # the input permutation runs in the step


@pytest.mark.parametrize("spec", [{"method": "ngram"}, {"method": "layer_skip", "draft_layers": 1}])
def test_speculative_decoding_identical(spec, tiny_llama, native_calls):
    rep = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9, list(range(3, 40))]
    eager, native = _both(tiny_llama, prompts=rep, max_tokens=(24, 1),
                          speculative={**spec, "max_batch_size": 64, "disable_below_acceptance": 0.0})
    assert native == eager and native_calls


@pytest.mark.parametrize(("family", "mode", "kv"), [("tiny_llama", "native", "auto"), ("tiny_llama", "eager", "auto"),
                                                   ("tiny_gemma3", "native", "auto"),
                                                   ("tiny_mistral_sw", "native", "int8")])
def test_speculative_greedy_equals_plain_decoding(family, mode, kv, request, native_calls):
    """A speculating sequence's last token and drafts are laid out as decode rows (each over the context up to
    it), so verification computes each token as a plain decode of it would, bit for bit: bf16 greedy tokens
    with n-gram speculation equal plain decoding's (on these near-tie-rich random models they diverged when
    verification ran as prefill chunks), past sliding windows and on an int8 cache too, and the native step
    runs the verify steps."""
    rep = [[5, 6, 7, 8, 9] * 8, [11, 12, 13] * 12, list(range(3, 50)), [20, 21] * 20]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    model = str(request.getfixturevalue(family))
    plain = LLM(model, dtype="bfloat16", device="cpu", num_kv_blocks=64, decode_step=mode, kv_cache_dtype=kv)
    spec = LLM(model, dtype="bfloat16", device="cpu", num_kv_blocks=64, decode_step=mode, kv_cache_dtype=kv,
               speculative={"method": "ngram", "disable_below_acceptance": 0.0})
    want = token_ids(plain, rep, params)
    native_calls.clear()
    stats: list = []
    spec.engine.stat_listeners.append(stats.append)
    assert token_ids(spec, rep, params) == want
    assert sum(st.spec_num_accepted_tokens for st in stats) > 0  # drafts were accepted, not just proposed
    if mode == "native":
        assert max(native_calls) > len(rep)  # a step of verify rows (several per sequence) ran natively


def test_prefix_cache_and_logprobs_identical(tiny_llama, native_calls):
    shared = list(range(3, 60))
    prompts = [shared + [100 + i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    out = []
    for mode in ("eager", "native"):
        llm = LLM(str(tiny_llama), dtype="bfloat16", device="cpu", num_kv_blocks=64, decode_step=mode)
        res = [o.outputs[0] for o in llm.generate(prompts, params)]
        out.append([(c.token_ids, [sorted(lp.items()) for lp in c.logprobs]) for c in res])
    assert out[0] == out[1] and native_calls


@pytest.mark.parametrize("codes", ["int8", "fp8"])
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_gemma3"])
def test_quantized_kv_cache_identical(codes, family, request, native_calls):
    """int8 / fp8 KV: the step quantizes its K/V rows in C (the eager step in torch: the same bytes) and
    both read them with the same kernel; Gemma 3 with its sliding pools."""
    eager, native = _both(request.getfixturevalue(family), prompts=PROMPTS[:8], kv_cache_dtype=codes)
    assert native == eager and native_calls
    llm = LLM(str(request.getfixturevalue(family)), dtype="bfloat16", device="cpu", num_kv_blocks=64,
              kv_cache_dtype=codes)
    ops = llm.engine.runner.decode_step.program.ops
    want = {"int8": 1, "fp8": 2}[codes]
    assert {op.i[1] for op in ops if op.kind == OP_KV_WRITE} == {want}
    assert {op.i[2] for op in ops if op.kind == OP_ATTEND} == {want}


def test_what_the_step_does_not_take_runs_eagerly(tiny_llama, tiny_qwen3_moe, native_calls):  # noqa: F811
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    moe = LLM(str(tiny_qwen3_moe), dtype="bfloat16", device="cpu", num_kv_blocks=64)
    block = moe.engine.model.layers[0].mlp
    seen = []
    block.experts[0].down_proj.register_forward_hook(lambda m, a, o: seen.append(o.shape[0]))
    runner = moe.engine.runner
    runner.decode_step = DecodeStep.build(moe.engine.model, runner.cache, runner.attn_backend)
    assert runner.decode_step is None  # a hooked expert: neither the step nor the C block runs it
    assert len(token_ids(moe, PROMPTS[:2], params)[0]) == 4
    assert seen and isinstance(block.native(), str)
    for engine in ({"dtype": "float32"}, {"dtype": "bfloat16", "enforce_eager": True}):
        llm = LLM(str(tiny_llama), device="cpu", num_kv_blocks=64, **engine)
        assert llm.engine.runner.decode_step is None, engine
    assert not native_calls


def _split_qkv(llm: LLM) -> None:
    """Each layer's fused q|k|v as a ConcatLinear of three packed parts (what the loader makes of a checkpoint
    whose parts cannot merge), then the native step rebuilt over them."""
    model, runner = llm.engine.model, llm.engine.runner
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        w, parts, start = attn.qkv_proj.weight, [], 0
        for n in (attn.q_size, attn.kv_size, attn.kv_size):
            lin = nn.Linear(w.shape[1], n, bias=False, dtype=torch.bfloat16)
            with torch.no_grad():
                lin.weight.copy_(w[start:start + n])
            parts.append(PackedLinear(lin))
            start += n
        set_submodule(model, f"layers.{i}.self_attn.qkv_proj", ConcatLinear(parts))
    if runner.decode_step is not None:
        runner.decode_step = DecodeStep.build(model, runner.cache, runner.attn_backend)


def test_a_concat_linear_runs_each_part_into_its_columns(tiny_llama, native_calls):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = {}
    for mode in ("eager", "native"):
        # no prefix cache: the second run would prefill only past the first's cached blocks, in steps of other
        # sizes, whose last bits may differ for reasons of their own
        llm = LLM(str(tiny_llama), dtype="bfloat16", device="cpu", num_kv_blocks=64, decode_step=mode,
                  enable_prefix_caching=False)
        out[f"{mode} fused"] = token_ids(llm, PROMPTS[:5], params)
        _split_qkv(llm)
        out[f"{mode} parts"] = token_ids(llm, PROMPTS[:5], params)
    step = llm.engine.runner.decode_step
    assert sum(op.kind == OP_COPY_COLS for op in step.program.ops) == 3 * len(llm.engine.model.layers)
    assert out["native parts"] == out["eager parts"]
    # each output is its own dot product in the kernel: splitting the rows changes no bit
    assert out["native parts"] == out["native fused"] == out["eager fused"]
