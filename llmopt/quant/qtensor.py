"""QuantizedWeight: the one in-memory form every algorithm produces and every format/kernel reads.

Integer convention (int4 and int8, GPTQ-compatible):

    w ≈ (q − zero) · scale        q ∈ [0, 2^bits − 1] unsigned, zero an integer in the same range

* symmetric: `zero` is None and means the fixed value 2^(bits−1) (8 for int4, 128 for int8), so
  w = (q − 8)·scale. This is exactly GPTQ's symmetric convention (stored v1 zero 7 = 8 − 1) and
  exactly compressed-tensors' signed int4 (q_signed = q − 8, packed with a +8 offset).
* asymmetric: `zero` is per (out, group); GPTQ stores zero − 1 (v1), compressed-tensors stores the
  signed zero − 2^(bits−1) and adds the offset back when packing, i.e. the same unsigned nibble.
  Our quantizers keep asymmetric zeros in [1, maxq] so the v1 "zero − 1" never underflows.

fp8 (`scheme.kind == "fp8"`): `q` holds float8_e4m3fn values, `scale` is [out, 1] and w = q·scale.

`g_idx[c]` is the group of input column c. It is `c // group_size` unless GPTQ ran with act-order
(without static groups), in which case groups follow the activation order instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmopt.errors import LlmoptError
from llmopt.quant.scheme import QuantScheme

BLOCK_ELEMENTS = 1 << 22  # elements of a weight that one block of rows covers: 16 MB a float32 temporary


def row_blocks(rows: int, cols: int) -> list[slice]:
    """Slices of whole rows covering [rows, cols], each about `BLOCK_ELEMENTS` (one slice for a small weight):
    element-wise quantize / dequantize work a block at a time, the same values with temporaries that small."""
    step = max(1, BLOCK_ELEMENTS // max(1, cols))
    return [slice(lo, lo + step) for lo in range(0, rows, step)]


def identity_g_idx(
    in_features: int, group_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """g_idx for contiguous groups (`group_size=-1`: one group)."""
    gs = in_features if group_size == -1 else group_size
    return (torch.arange(in_features, device=device, dtype=torch.int32) // gs).to(torch.int32)


@dataclass
class QuantizedWeight:
    """Integer (or fp8) codes plus the parameters that map them back to floats; see module doc."""

    q: torch.Tensor  # [out, in] uint8 codes (int) or float8_e4m3fn (fp8)
    scale: torch.Tensor  # [out, n_groups] float32 (values representable in scheme.scale_dtype)
    zero: torch.Tensor | None  # [out, n_groups] uint8 integer zero points; None = symmetric
    g_idx: torch.Tensor  # [in] int32
    scheme: QuantScheme

    def __post_init__(self) -> None:
        if self.q.dim() != 2:
            raise LlmoptError(f"quantized weight must be 2-D [out, in], got shape {tuple(self.q.shape)}")
        out, inp = self.q.shape
        groups = self.scheme.n_groups(inp)
        if self.scheme.kind == "fp8":
            if self.q.dtype != torch.float8_e4m3fn:
                raise LlmoptError(f"fp8 codes must be float8_e4m3fn, got {self.q.dtype}")
        elif self.q.dtype != torch.uint8:
            raise LlmoptError(f"int codes must be uint8 (unsigned, zero-offset), got {self.q.dtype}")
        if tuple(self.scale.shape) != (out, groups):
            raise LlmoptError(f"scale shape {tuple(self.scale.shape)} != expected {(out, groups)}")
        if self.zero is not None:
            if self.scheme.symmetric:
                raise LlmoptError("symmetric schemes carry no zero tensor (zero is 2^(bits-1))")
            if tuple(self.zero.shape) != (out, groups):
                raise LlmoptError(f"zero shape {tuple(self.zero.shape)} != expected {(out, groups)}")
        elif not self.scheme.symmetric:
            raise LlmoptError("asymmetric schemes need a zero tensor")
        if tuple(self.g_idx.shape) != (inp,):
            raise LlmoptError(f"g_idx shape {tuple(self.g_idx.shape)} != expected {(inp,)}")
        self.g_idx = self.g_idx.to(torch.int32)

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1]

    @property
    def n_groups(self) -> int:
        return self.scale.shape[1]

    @property
    def group_size(self) -> int:
        """Columns per group (in_features for per-channel)."""
        return self.in_features // self.n_groups

    @property
    def is_act_order(self) -> bool:
        """True when groups are not contiguous column ranges (GPTQ act-order without static groups)."""
        ident = identity_g_idx(self.in_features, self.group_size, self.g_idx.device)
        return not torch.equal(self.g_idx, ident)

    def zero_points(self) -> torch.Tensor:
        """Integer zero points [out, n_groups] (int32), with the symmetric fixed value filled in."""
        if self.zero is not None:
            return self.zero.to(torch.int32)
        return torch.full_like(self.scale, self.scheme.sym_zero, dtype=torch.int32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Float weight [out, in]: computed in float32 (exact for these small integers), then cast. By blocks
        of rows, so the float32 temporaries stay small beside the result (whole, they were five times an
        8B down_proj's float32 weight)."""
        out = torch.empty(self.q.shape, dtype=dtype, device=self.q.device)
        for rows in row_blocks(self.out_features, self.in_features):
            out[rows] = self.dequantize_rows(rows)
        return out

    def dequantize_rows(self, rows: slice) -> torch.Tensor:
        """Rows `rows` of the float32 weight: what a consumer that goes by blocks of rows widens at a time."""
        idx = self.g_idx.long()
        scale = self.scale[rows].float()[:, idx]
        if self.scheme.kind == "fp8":
            return self.q[rows].float() * scale
        zero = self.scheme.sym_zero if self.zero is None else self.zero[rows].to(torch.int32)[:, idx]
        return (self.q[rows].to(torch.int32) - zero).float() * scale

    def relative_error(self, w: torch.Tensor) -> float:
        """‖dequantized − w‖ / ‖w‖ over the whole weight (`w` in any float dtype), a block of rows at a time."""
        err = norm = 0.0
        for rows in row_blocks(self.out_features, self.in_features):
            wr = w[rows].float()
            err += float((self.dequantize_rows(rows) - wr).pow(2).sum())
            norm += float(wr.pow(2).sum())
        return math.sqrt(err) / max(math.sqrt(norm), 1e-12)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return QuantizedWeight(
            q=self.q.to(device),
            scale=self.scale.to(device),
            zero=None if self.zero is None else self.zero.to(device),
            g_idx=self.g_idx.to(device),
            scheme=self.scheme,
        )

    def nbytes(self) -> int:
        """Bytes this weight takes once bit-packed (codes at `bits` each, plus scales and zeros)."""
        codes = self.q.numel() * self.scheme.bits // 8
        params = self.scale.numel() * self.scheme.torch_scale_dtype.itemsize
        zeros = 0 if self.zero is None else self.zero.numel() * self.scheme.bits // 8
        return codes + params + zeros
