"""Bit packing of unsigned codes into int32 words, least-significant bits first.

Element j of each run of 32/bits values along the packed dimension occupies bits
[j·bits, (j+1)·bits) of its word. Both GPTQ (`qweight`, `qzeros`) and compressed-tensors
(`weight_packed`, `weight_zero_point`) use this order; they differ only in which dimension is packed.
"""

from __future__ import annotations

import torch

from llmopt.errors import LlmoptError


def _per_word(bits: int) -> int:
    if bits not in (2, 4, 8, 16):
        raise LlmoptError(f"int32 packing supports 2, 4, 8 or 16 bits, got {bits}")
    return 32 // bits


def pack_int32(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack a 2-D tensor of unsigned codes (< 2^bits) along `dim` into int32, padding with zeros."""
    per = _per_word(bits)
    if codes.dim() != 2:
        raise LlmoptError(f"pack_int32 expects a 2-D tensor, got shape {tuple(codes.shape)}")
    c = codes.to(torch.int64)
    if dim == 0:
        c = c.t()
    rows, n = c.shape
    words = -(-n // per)
    if words * per != n:
        c = torch.nn.functional.pad(c, (0, words * per - n))
    c = c.reshape(rows, words, per) & ((1 << bits) - 1)
    shifts = torch.arange(0, 32, bits, device=c.device, dtype=torch.int64)
    packed = (c << shifts).sum(-1)  # disjoint bit ranges: sum == bitwise or
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    if dim == 0:
        packed = packed.t()
    return packed.contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, count: int) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 words -> unsigned codes (uint8 for bits <= 8, else int32)."""
    per = _per_word(bits)
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise LlmoptError(
            f"unpack_int32 expects a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}"
        )
    p = packed.to(torch.int64) & 0xFFFFFFFF
    if dim == 0:
        p = p.t()
    rows, words = p.shape
    if count > words * per:
        raise LlmoptError(f"cannot unpack {count} values from {words} words of {bits}-bit codes")
    shifts = torch.arange(0, 32, bits, device=p.device, dtype=torch.int64)
    codes = ((p[..., None] >> shifts) & ((1 << bits) - 1)).reshape(rows, words * per)[:, :count]
    if dim == 0:
        codes = codes.t()
    return codes.to(torch.uint8 if bits <= 8 else torch.int32).contiguous()
