"""Row-wise argmax for the sampler, far faster than `torch.argmax` on a CPU (whose kernel is far slower than
`amax`): one C call (`argmax.c`) where it can be built, else a block-wise argmax in torch.

Both equal `torch.argmax`: the first index of each row's maximum, NaN counted as the maximum. The block-wise
one takes each block's max, the first block holding the row's max, then an argmax inside it; NaN rows and odd
vocabularies take `torch.argmax` itself.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

import llmopt.native as native

SOURCE = Path(__file__).with_name("argmax.c")
BLOCK = 128  # Llama 3 (128256), Qwen (151936), Gemma 3 (262144) and SmolLM2 (49152) split evenly


class ArgmaxKernel:
    """The loaded `argmax.c`."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.argmax_f32.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]
        lib.argmax_f32.restype = None
        self._fn, self.path = lib.argmax_f32, path

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        n, vocab = logits.shape
        out = torch.empty(n, dtype=torch.long)
        self._fn(logits.data_ptr(), n, vocab, logits.stride(0), out.data_ptr(), torch.get_num_threads())
        return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] long: the first index of each row's maximum."""
    n, vocab = logits.shape
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    if logits.dtype == torch.float32 and logits.stride(-1) == 1 and n and vocab:
        kernel = native.load(SOURCE, ArgmaxKernel, "argmax runs in torch")
        if kernel is not None:
            return kernel(logits)
    return _blockwise(logits)


def _blockwise(logits: torch.Tensor) -> torch.Tensor:
    n, vocab = logits.shape
    if vocab % BLOCK or vocab < 4 * BLOCK:
        return logits.argmax(dim=-1)
    blocks = logits.view(n, vocab // BLOCK, BLOCK)
    block_max = blocks.amax(dim=-1)  # [N, V/BLOCK]
    row_max = block_max.amax(dim=-1, keepdim=True)
    if torch.isnan(row_max).any():
        return logits.argmax(dim=-1)
    first = (block_max == row_max).int().argmax(dim=-1)  # the first block that holds the maximum
    inside = blocks[torch.arange(n, device=logits.device), first].argmax(dim=-1)
    return first * BLOCK + inside
