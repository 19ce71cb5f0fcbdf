"""The sampler's argmax against torch.argmax, in C (argmax.c) and block-wise in torch: same index, ties to the
first, -inf rows, NaN as the maximum, -0.0 equal to 0.0, strided rows, odd vocabularies."""

from __future__ import annotations

import pytest
import torch

import llmopt.native as native
from llmopt.engine.argmax import BLOCK, SOURCE, ArgmaxKernel, _blockwise, argmax


def _kernel() -> ArgmaxKernel:
    kernel = native.load(SOURCE, ArgmaxKernel, "argmax runs in torch")
    if kernel is None:
        pytest.skip("no C compiler here")
    return kernel


IMPLS = ["kernel", "blockwise"]


def _run(impl: str, x: torch.Tensor) -> torch.Tensor:
    return _kernel()(x) if impl == "kernel" else _blockwise(x)


def _cases(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g).to(dtype)
    x[1, :] = 0.0  # all tied: index 0
    x[2, 5], x[2, vocab - 1] = 50.0, 50.0  # a tie across blocks: the first
    x[3, :] = float("-inf")
    x[3, vocab // 2] = -3.0  # one finite entry (a grammar mask leaves few)
    x[4, vocab - 1] = 99.0  # the maximum in the last block
    x[5, 1], x[5, 2] = 7.0, 7.0  # a tie inside one block
    x[6, :] = float("-inf")  # every token masked: index 0
    x[7, 3], x[7, vocab - 2] = float("inf"), float("inf")
    return x


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("vocab", [BLOCK * 4, 49152, 262144, 1000, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torch_argmax(impl, vocab, dtype):
    if impl == "kernel" and dtype != torch.float32:
        pytest.skip("the kernel takes float32 logits (what compute_logits returns)")
    x = _cases(vocab, dtype)
    assert torch.equal(_run(impl, x), x.argmax(dim=-1))
    assert torch.equal(argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_is_the_maximum_and_signed_zeros_tie(impl):
    x = torch.randn(5, BLOCK * 8)
    x[0, 17] = float("nan")
    x[1, 40], x[1, 900], x[1, 3] = float("nan"), float("nan"), float("inf")  # the first NaN wins over inf
    x[2, :] = -1.0
    x[2, 10], x[2, 20] = -0.0, 0.0  # -0.0 == 0.0: the first
    x[3, 200] = -float("nan")  # a NaN with its sign bit set is a NaN too
    assert torch.equal(_run(impl, x), x.argmax(dim=-1))
    assert _run(impl, x)[2].item() == 10


def test_kernel_reads_strided_rows_and_many_rows():
    wide = torch.randn(300, 5000)
    x = wide[:, :4096]  # rows 5,000 floats apart
    assert torch.equal(_kernel()(x), x.argmax(dim=-1))
    assert torch.equal(argmax(x), x.argmax(dim=-1))
