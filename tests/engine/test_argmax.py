"""The blocked argmax against torch.argmax: same index, ties to the first, -inf rows, NaN, odd vocabularies."""

from __future__ import annotations

import pytest
import torch

from llmopt.engine.argmax import BLOCK, argmax


@pytest.mark.parametrize("vocab", [BLOCK * 4, 49152, 262144, 1000, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torch_argmax(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g).to(dtype)
    x[1, :] = 0.0  # all tied: index 0
    x[2, 5], x[2, vocab - 1] = 50.0, 50.0  # a tie across blocks: the first
    x[3, :] = float("-inf")
    x[3, vocab // 2] = -3.0  # one finite entry (a grammar mask leaves few)
    x[4, vocab - 1] = 99.0  # the maximum in the last block
    x[5, 1], x[5, 2] = 7.0, 7.0  # a tie inside one block
    assert torch.equal(argmax(x), x.argmax(dim=-1))


def test_a_row_with_nan_falls_back_to_torch():
    x = torch.randn(3, BLOCK * 8)
    x[1, 17] = float("nan")
    assert torch.equal(argmax(x), x.argmax(dim=-1))
