"""oneDNN-packed bf16/fp16 linears (CPU engines): the same results as F.linear, swapped in only where
they apply, and an engine that packs generating what an eager one does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmopt import LLM, SamplingParams
from llmopt.layers.linear import FusedLinear
from llmopt.layers.moe import SparseMoeBlock
from llmopt.layers.packed_linear import PackedLinear, pack_linears, packing_supported
from llmopt.quant.linear import Int8WeightOnlyLinear
from llmopt.quant.rtn import rtn_quantize
from llmopt.quant.scheme import QuantScheme
from llmopt.testing.tiny_model import write_tiny_moe

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(not packing_supported(torch.bfloat16, CPU),
                                   reason="this torch build's oneDNN has no bf16 matmul")


@needs_packing
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, bias):
    if not packing_supported(dtype, CPU):
        pytest.skip(f"no oneDNN {dtype} matmul here")
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96, generator=g))
    packed = PackedLinear(lin)
    for rows in (1, 3, 16):  # decode sizes: in bf16 the very same oneDNN kernel, bitwise
        x = torch.randn(rows, 96, generator=g).to(dtype)
        got, want = packed(x), F.linear(x, lin.weight, lin.bias)
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:  # torch's fp16 F.linear on a CPU is another kernel: the same up to fp16 rounding
            assert torch.allclose(got, want, atol=1e-2, rtol=1e-3)
    x = torch.randn(2, 150, 96, generator=g).to(dtype)  # a prefill-sized 3-D batch
    want = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    got = packed(x)
    assert got.shape == (2, 150, 200) and got.dtype == dtype
    assert torch.allclose(got.float(), want, atol=0.1, rtol=0.02)
    assert torch.equal(packed.weight, lin.weight)  # unpacks back exactly
    assert torch.equal(packed.state_dict()["weight"], lin.weight)


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
def test_pack_linears_leaves_moe_experts_to_their_grouped_path(tmp_path):
    llm = LLM(str(write_tiny_moe(tmp_path / "moe")), dtype="bfloat16")
    model = llm.engine.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    for block in blocks:
        assert all(type(e.gate_up_proj) is not PackedLinear for e in block.experts)
    assert isinstance(model.layers[0].self_attn.qkv_proj, PackedLinear)
    assert isinstance(model.lm_head, PackedLinear)


@needs_packing
def test_bf16_engine_packs_and_generates_what_an_eager_one_does(tiny_llama):
    """Prompts and batches under 17 rows keep every matmul at decode size, where the packed kernel is
    bitwise F.linear's: the same tokens and the same logprobs. enforce_eager leaves the weights plain,
    fp32 is never packed."""
    packed = LLM(str(tiny_llama), dtype="bfloat16")
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
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
