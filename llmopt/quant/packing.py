"""Bit packing of unsigned codes into int32 words, least-significant bits first.

Element j of each run of 32/bits values along the packed dimension occupies bits
[j·bits, (j+1)·bits) of its word. Both GPTQ (`qweight`, `qzeros`) and compressed-tensors
(`weight_packed`, `weight_zero_point`) use this order; they differ only in which dimension is packed.
"""

from __future__ import annotations

import torch

from llmopt.errors import LlmoptError
from llmopt.quant.qtensor import row_blocks


def _per_word(bits: int) -> int:
    if bits not in (2, 4, 8, 16):
        raise LlmoptError(f"int32 packing supports 2, 4, 8 or 16 bits, got {bits}")
    return 32 // bits


def pack_int32(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack a 2-D tensor of unsigned codes (< 2^bits) along `dim` into int32, padding with zeros. By blocks of
    rows (`qtensor.row_blocks`): the int64 arithmetic is 32 times the codes' bytes, 4.2 GB for an 8B model's
    int4 head taken whole."""
    per = _per_word(bits)
    if codes.dim() != 2:
        raise LlmoptError(f"pack_int32 expects a 2-D tensor, got shape {tuple(codes.shape)}")
    c = codes.t() if dim == 0 else codes
    rows, n = c.shape
    words = -(-n // per)
    packed = torch.empty(rows, words, dtype=torch.int32, device=c.device)
    shifts = torch.arange(0, 32, bits, device=c.device, dtype=torch.int64)
    for block in row_blocks(rows, words * per):
        b = c[block].to(torch.int64)
        if words * per != n:
            b = torch.nn.functional.pad(b, (0, words * per - n))
        b = (b.reshape(-1, words, per) & ((1 << bits) - 1)) << shifts
        w = b.sum(-1)  # disjoint bit ranges: sum == bitwise or
        packed[block] = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    return packed.t().contiguous() if dim == 0 else packed


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, count: int) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 words -> unsigned codes (uint8 for bits <= 8, else int32), by blocks of
    rows as it packs."""
    per = _per_word(bits)
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise LlmoptError(
            f"unpack_int32 expects a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}"
        )
    p = packed.t() if dim == 0 else packed
    rows, words = p.shape
    if count > words * per:
        raise LlmoptError(f"cannot unpack {count} values from {words} words of {bits}-bit codes")
    codes = torch.empty(rows, count, dtype=torch.uint8 if bits <= 8 else torch.int32, device=p.device)
    shifts = torch.arange(0, 32, bits, device=p.device, dtype=torch.int64)
    for block in row_blocks(rows, words * per):
        b = p[block].to(torch.int64) & 0xFFFFFFFF
        codes[block] = ((b[..., None] >> shifts) & ((1 << bits) - 1)).reshape(-1, words * per)[:, :count]
    return codes.t().contiguous() if dim == 0 else codes
