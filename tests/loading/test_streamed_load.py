"""The one loader: every format lands module by module, so loading never holds the model twice."""

from __future__ import annotations

import pytest
import torch

from llmopt.layers.packed_linear import PackedLinear, packing_supported
from llmopt.loading.load import load_model, module_order
from llmopt.models.resolve import resolve_model
from llmopt.testing.live_bytes import LiveTensorBytes
from llmopt.testing.tiny_model import write_tiny_llama

needs_packing = pytest.mark.skipif(not packing_supported(torch.bfloat16, torch.device("cpu")),
                                   reason="this CPU has no bf16 packing (oneDNN without avx512_bf16)")


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("bf16"), num_layers=6, hidden_size=256, intermediate_size=768,
                            num_heads=4, num_kv_heads=2, dtype="bfloat16", tie_word_embeddings=False)


def test_module_order_is_the_forward_order(bf16_llama):
    model = load_model(resolve_model(str(bf16_llama)), "bfloat16")
    assert module_order(model) == ["embed_tokens", *[f"layers.{i}" for i in range(6)], "norm", "lm_head"]


@needs_packing
def test_packing_while_loading_holds_one_layer_of_plain_weights_at_most(bf16_llama):
    """Live tensor bytes while loading with packing peak at the packed model plus about one module's plain
    weights (the largest, here the untied head), never at two models."""
    resolved = resolve_model(str(bf16_llama))
    load_model(resolved, "bfloat16", pack=True)  # warm: kernels built, caches filled
    with LiveTensorBytes() as m:
        model = load_model(resolved, "bfloat16", pack=True)
    packed = m.live
    assert isinstance(model.layers[0].mlp.down_proj, PackedLinear)
    s = resolved.spec
    largest = 2 * max(s.vocab_size * s.hidden_size, s.layer_params(0))  # bf16 bytes of the biggest module
    assert m.peak <= packed + largest * 1.1, (m.peak, packed, largest)
    assert m.peak < 1.5 * packed  # loading then packing the whole model would peak near 2x


@needs_packing
def test_packed_while_loading_computes_what_the_plain_model_computes(bf16_llama):
    resolved = resolve_model(str(bf16_llama))
    plain = load_model(resolved, "bfloat16")
    packed = load_model(resolved, "bfloat16", pack=True)
    for name in ("layers.2.mlp.down_proj", "lm_head"):
        a, b = plain.get_submodule(name), packed.get_submodule(name)
        assert type(a) is not PackedLinear and isinstance(b, PackedLinear)
        x = torch.randn(3, a.in_features, dtype=torch.bfloat16)
        assert torch.equal(a.weight, b.weight)  # the packed copy unpacks to the very same weight
        torch.testing.assert_close(a(x), b(x), rtol=2e-2, atol=2e-2)
