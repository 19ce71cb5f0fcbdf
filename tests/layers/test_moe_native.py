"""The sparse MoE block in C (moe_block.c via moe_native.py) against the block's torch path on the same packed
weights: routing (tokens per expert exactly, where the router's logits do not tie), outputs within bf16 rounding of a float32 sum, every row the same
whatever the batch it runs in, and the cases it leaves to torch."""

from __future__ import annotations

import pytest
import torch

from llmopt import LLM
from llmopt.layers.kernels import Ops
from llmopt.layers.moe import SparseMoeBlock
from llmopt.layers.moe_native import NativeMoe
from llmopt.layers.packed_linear import vnni_kernel
from tests.models.families import tiny_mixtral, tiny_qwen2_moe, tiny_qwen3_moe  # noqa: F401

pytestmark = pytest.mark.skipif(vnni_kernel() is None, reason="no AVX512-BF16 here: MoE blocks run in torch")


def _torch_block(block: SparseMoeBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's per-expert torch path over the same (packed) projections, with its tokens per expert."""
    weights, experts = block.route(x)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=block.num_experts)
    out = block._looped(x, Ops.EAGER, weights.reshape(-1), order, counts.tolist())
    if block.shared_expert is not None:
        out = out + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out, counts


def _blocks(model_dir) -> list[SparseMoeBlock]:
    llm = LLM(str(model_dir), dtype="bfloat16", device="cpu", num_kv_blocks=16)
    return [m for m in llm.engine.model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.mark.parametrize("family", ["tiny_qwen3_moe", "tiny_mixtral", "tiny_qwen2_moe"])
def test_c_block_matches_the_torch_path(family, request):
    g = torch.Generator().manual_seed(0)
    for block in _blocks(request.getfixturevalue(family)):
        native = block.native()
        assert isinstance(native, NativeMoe), native
        x = torch.randn(64, block.gate.in_features, generator=g).to(torch.bfloat16)
        # rows whose k-th and next router logits tie (bf16 logits often do) may take either expert: torch's top-k
        # breaks ties one way or the other, C always takes the lower id; compare the other rows
        top = block.gate(x).float().sort(dim=-1, descending=True).values
        x = x[top[:, block.top_k - 1] != top[:, block.top_k]].contiguous()
        assert x.shape[0] >= 32
        out, counts = native(x)
        ref, ref_counts = _torch_block(block, x)
        assert torch.equal(counts, ref_counts)  # the same experts chosen for every token
        # torch rounds each weighted expert output and each partial sum to bf16; C sums in float32, rounds once
        scale = ref.float().abs().amax(dim=-1, keepdim=True)
        assert ((out.float() - ref.float()).abs() <= 2 ** -6 * scale).all()
        for rows in (1, 2, 5):  # a row's output does not depend on the rows beside it
            assert torch.equal(native(x[:rows].contiguous())[0], out[:rows])
        assert torch.equal(block(x), out) and torch.equal(block.last_counts, counts)  # forward takes the C path


def test_blocks_the_c_path_does_not_take_run_in_torch(tiny_qwen3_moe):  # noqa: F811
    """A hooked projection (calibration, inspection) or `calibrate_all` sends the block to torch, where the hooks
    fire; once the hooks are gone the C path runs again."""
    block = _blocks(tiny_qwen3_moe)[0]
    x = torch.randn(9, block.gate.in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    c_out = block(x)
    seen: list[int] = []
    handle = block.experts[0].gate_up_proj.register_forward_hook(lambda m, a, o: seen.append(o.shape[0]))
    assert block.native() == "a projection has hooks"
    hooked = block(x)
    assert seen == ([int(block.last_counts[0])] if int(block.last_counts[0]) else [])
    scale = c_out.float().abs().amax(dim=-1, keepdim=True)
    assert ((hooked.float() - c_out.float()).abs() <= 2 ** -6 * scale).all()
    block.calibrate_all = frozenset({0})  # calibration: expert 0 sees every token
    seen.clear()
    block(x)
    assert seen == [9]
    block.calibrate_all = frozenset()
    handle.remove()
    assert isinstance(block.native(), NativeMoe) and torch.equal(block(x), c_out)
