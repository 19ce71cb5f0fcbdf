"""A SparseMoeBlock in one C call (`moe_block.c`): routing and every routed expert over our matmul kernels, for
bf16 CPU blocks whose projections all run on them (`kernel_linear`). The eager block and the decode step call
the same function with the same spec, so they agree bit for bit; `NativeMoe` is that spec, built once per block
and kept alive with the tensors it points into."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

import llmopt.native as native
from llmopt.layers import native_ops
from llmopt.layers.kernel_linear import KernelLinear, kernel_linear
from llmopt.layers.packed_linear import vnni_kernel

SOURCE = Path(__file__).with_name("moe_block.c")


class CLinear(ctypes.Structure):
    """moe_block.c's klinear_t."""

    _fields_ = [("storage", ctypes.c_int32), ("in_", ctypes.c_int64), ("out", ctypes.c_int64),
                ("group", ctypes.c_int64), ("amx_min_rows", ctypes.c_int64), ("packed", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("perm", ctypes.c_void_p)]


ABSENT = CLinear(storage=-1)


class CMoe(ctypes.Structure):
    """moe_block.c's moe_t."""

    _fields_ = [("linear", ctypes.c_void_p), ("linear_amx", ctypes.c_void_p), ("linear_int4", ctypes.c_void_p),
                ("linear_int4_amx", ctypes.c_void_p), ("act", ctypes.c_void_p), ("hidden", ctypes.c_int64),
                ("num_experts", ctypes.c_int64), ("top_k", ctypes.c_int64), ("inter", ctypes.c_int64),
                ("shared_inter", ctypes.c_int64), ("norm_topk", ctypes.c_int32), ("gelu", ctypes.c_int32),
                ("router", CLinear), ("experts", ctypes.POINTER(CLinear)), ("shared_gate_up", CLinear),
                ("shared_down", CLinear), ("shared_gate", CLinear)]


class MoeKernel:
    """The loaded `moe_block.c`."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.moe_block.argtypes = [ptr, ptr, i64, ptr, ptr, ctypes.c_int]
        lib.moe_block.restype = ctypes.c_int
        self.fn, self.path = lib.moe_block, path

    def address(self) -> int:
        """moe_block's address, for the decode step (llmopt/step/decode_step.c)."""
        return ctypes.cast(self.fn, ctypes.c_void_p).value or 0


def load() -> MoeKernel | None:
    return native.load(SOURCE, MoeKernel, "MoE blocks run their experts in torch")


def _c(k: KernelLinear) -> CLinear:
    p = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    return CLinear(storage=k.code, in_=k.in_features, out=k.out_features, group=k.group,
                   amx_min_rows=k.amx_min_rows, packed=p(k.packed), scale=p(k.scale), bias=p(k.bias), perm=p(k.perm))


class NativeMoe:
    """The C spec of one block (`tensors` keeps what it points into alive)."""

    def __init__(self, block: nn.Module, linears: list[tuple[nn.Module, KernelLinear]], kernel: MoeKernel,
                 addr: dict[str, int], gelu: bool):
        experts = [k for _, k in linears[1:1 + 2 * block.num_experts]]
        shared = [k for _, k in linears[1 + 2 * block.num_experts:]]  # gate|up, down, gate
        self.tensors = [t for _, k in linears for t in (k.packed, k.scale, k.bias, k.perm) if t is not None]
        self.experts = (CLinear * len(experts))(*map(_c, experts))
        self.spec = CMoe(linear=addr["linear"], linear_amx=addr["linear_amx"], linear_int4=addr["linear_int4"],
                         linear_int4_amx=addr["linear_int4_amx"], act=addr["act"],
                         hidden=linears[0][1].in_features, num_experts=block.num_experts,
                         top_k=block.top_k, inter=experts[0].out_features // 2,
                         shared_inter=shared[0].out_features // 2 if shared else 0,
                         norm_topk=int(block.norm_topk_prob), gelu=int(gelu), router=_c(linears[0][1]),
                         experts=self.experts, shared_gate_up=_c(shared[0]) if shared else ABSENT,
                         shared_down=_c(shared[1]) if shared else ABSENT,
                         shared_gate=_c(shared[2]) if shared else ABSENT)
        self.kernel = kernel

    @property
    def address(self) -> int:
        return ctypes.addressof(self.spec)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block output [T, hidden], tokens per expert) for x [T, hidden] bf16, contiguous."""
        out = torch.empty_like(x)
        counts = torch.empty(self.spec.num_experts, dtype=torch.int64)
        rc = self.kernel.fn(self.address, x.data_ptr(), x.shape[0], out.data_ptr(), counts.data_ptr(),
                            torch.get_num_threads())
        if rc:
            raise RuntimeError(f"MoE block kernel failed (code {rc})")
        return out, counts


def native_moe(block: nn.Module, modules: tuple[nn.Module, ...], gelu: bool) -> NativeMoe | str:
    """The block's spec, or why it has none. `modules`: router, each expert's gate|up and down, then the shared
    expert's gate|up, down and gate (if any)."""
    kernel, vnni, ops = load(), vnni_kernel(), native_ops.load()
    if kernel is None or vnni is None or ops is None:
        return "a kernel cannot be built here"
    linears = []
    for m in modules:
        k = kernel_linear(m)
        if isinstance(k, str):
            return k
        linears.append((m, k))
    return NativeMoe(block, linears, kernel, {**vnni.addresses(), **ops.addresses()}, gelu)
