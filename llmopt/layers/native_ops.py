"""The layers' element-wise functions in C (`native_ops.c`) for bf16 CPU decode steps, where one ctypes
call costs less than the eager ops it replaces. Each method has the name and signature of the eager
function it replaces (`@kernels.has_native`) and returns None for input it does not take (not bf16 rows
on a CPU), so the eager function runs."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

import llmopt.native as native

SOURCE = Path(__file__).with_name("native_ops.c")


def _bf16_cpu(x: torch.Tensor, dims: int) -> bool:
    """bf16 on a CPU, `dims` dimensions, the last one contiguous (the rows may lie further apart)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == dims and x.stride(-1) == 1


class NativeOps:
    """The loaded library, one method per eager function it replaces."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        lib.rms_norm_bf16.argtypes = [ptr, i64, ptr, ptr, ptr, f32, i32, ptr, i64, i64, i32]
        lib.rotary_bf16.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, i32]
        lib.gated_act_bf16.argtypes = [ptr, i64, i64, i32, ptr, i32]
        for fn in (lib.rms_norm_bf16, lib.rotary_bf16, lib.gated_act_bf16):
            fn.restype = None
        self._lib, self.path = lib, path

    def addresses(self) -> dict[str, int]:
        """The C functions' addresses, for callers that run them from C (llmopt/step/decode_step.c)."""
        lib = self._lib
        return {name: ctypes.cast(fn, ctypes.c_void_p).value or 0 for name, fn in
                (("norm", lib.rms_norm_bf16), ("rotary", lib.rotary_bf16), ("act", lib.gated_act_bf16))}

    def _norm(self, x, residual, weight, eps, offset):
        if not (_bf16_cpu(x, 2) and weight.dtype == torch.bfloat16 and weight.is_contiguous()
                and weight.shape == x.shape[-1:]):
            return None
        if residual is not None and not (residual.dtype == torch.bfloat16 and residual.is_contiguous()
                                         and residual.shape == x.shape):
            return None
        rows, dim = x.shape
        out = torch.empty(rows, dim, dtype=torch.bfloat16)
        total = None if residual is None else torch.empty_like(out)
        self._lib.rms_norm_bf16(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                                None if total is None else total.data_ptr(), weight.data_ptr(), eps, offset,
                                out.data_ptr(), rows, dim, torch.get_num_threads())
        return out if residual is None else (out, total)

    def rms_norm(self, x, weight, eps):
        return self._norm(x, None, weight, eps, 0)

    def add_rms_norm(self, x, residual, weight, eps):
        return self._norm(x, residual, weight, eps, 0)

    def offset_rms_norm(self, x, weight, eps):
        return self._norm(x, None, weight, eps, 1)

    def add_offset_rms_norm(self, x, residual, weight, eps):
        return self._norm(x, residual, weight, eps, 1)

    def apply_rotary(self, x, cos, sin):
        """x [T, H, D] with contiguous heads (a view of the fused qkv output is fine); cos, sin [T, 1, D]."""
        if not (_bf16_cpu(x, 3) and x.stride(1) == x.shape[2] and cos.dtype == sin.dtype == torch.float32
                and cos.is_contiguous() and sin.is_contiguous() and cos.numel() == sin.numel() == x.shape[0] * x.shape[2]):
            return None
        t, h, d = x.shape
        out = torch.empty(t, h, d, dtype=torch.bfloat16)
        self._lib.rotary_bf16(x.data_ptr(), x.stride(0), h, d, cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t,
                              torch.get_num_threads())
        return out

    def _gated(self, x, intermediate_size, gelu):
        if not (_bf16_cpu(x, 2) and x.is_contiguous() and x.shape[1] == 2 * intermediate_size):
            return None
        out = torch.empty(x.shape[0], intermediate_size, dtype=torch.bfloat16)
        self._lib.gated_act_bf16(x.data_ptr(), x.shape[0], intermediate_size, gelu, out.data_ptr(),
                                 torch.get_num_threads())
        return out

    def silu_and_mul(self, x, intermediate_size):
        return self._gated(x, intermediate_size, 0)

    def gelu_tanh_and_mul(self, x, intermediate_size):
        return self._gated(x, intermediate_size, 1)


def load() -> NativeOps | None:
    """The kernels, built on first use; None (after one warning) when they cannot be built here."""
    return native.load(SOURCE, NativeOps, "element-wise layer functions run as eager torch ops")
