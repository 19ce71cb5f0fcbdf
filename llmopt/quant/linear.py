"""Runtime quantized linears: drop-in `nn.Module` swaps for `nn.Linear` that hold only packed
weights and run real low-bit kernels (gpt-fast style).

All modules cast activations to `compute_dtype` (bf16 by default: the CPU kernels are 4–15× slower
with fp32 activations), run the kernel on a 2-D view, add the bias and cast back to x's dtype.

Kernels (torch 2.13) and when each module falls back to dequantize-then-matmul:

* `Int4WeightOnlyLinear` — CPU with AVX512-BF16 or AVX2, symmetric groups of an even size and bf16 activations:
  our VNNI-panel kernel (`layers/bf16_linear.c`, `bf16_linear_int4`: up to 64 rows nibbles turned into
  bf16 by one table lookup, each group summed apart and folded in by its 16 outputs' scales; past that each
  panel dequantized once to bf16 (q − 8)·s, rounded as torch rounds it, and multiplied as bf16 weights;
  docs/BENCHMARKS.md). Otherwise on CPU:
  `aten._convert_weight_to_int4pack_for_cpu(q int32 [N, K], tiles)`
  → uint8 [N, K/2] and `aten._weight_int4pack_mm_for_cpu(x [M, K], packed, group, sz)`.
  CUDA: `aten._convert_weight_to_int4pack(uint8 [N, K/2] = q[:, 0::2] << 4 | q[:, 1::2], tiles)`
  and `aten._weight_int4pack_mm`. Both compute w = (q − 8)·scale + zero with
  sz [K/group, N, 2] = (scale, zero) in the activation dtype, so our w = (q − z)·s maps to
  (s, (8 − z)·s). Kernel groups must be 32/64/128/256: larger multiples of 32 repeat their scale,
  per-channel uses a kernel group dividing in_features; N is padded to a multiple of 16.
  Act-order weights are re-sorted by g_idx once and x's columns are permuted per call.
  Fallback: group size not a multiple of 32, or a g_idx that does not form equal groups.
* `Int8WeightOnlyLinear` — per-channel w int8 [N, K] with scales [N] (asymmetric zeros are a rank-1
  correction −rowsum(x)·(z − 128)·s). CPU: up to `int8_kernel.MAX_ROWS` rows of x, our C kernel
  (`int8_kernel.py`; `aten._weight_int8pack_mm` when it cannot be built); more rows, the weight
  dequantized to x's dtype per call and one dense matmul. CUDA: `aten._weight_int8pack_mm`.
  Fallback: grouped int8, act-order, and bf16 activations with K % 16 != 0 (torch 2.13's CPU bf16
  path returns garbage or crashes there).
* `Fp8WeightOnlyLinear` — weight-only: decode fp8 to compute_dtype per call through a 256-entry
  table (emulated; CPUs have no fp8 matmul units), scale applied to the output.
  `activation_fp8=True` instead quantizes x per token and calls `torch._scaled_mm` (W8A8; works
  on CPU in 2.13 but is not faster there, and changes numerics).

Kernel paths on non-CPU devices are checked once against the dequantized reference when built and
fall back (with a warning) if they disagree, since they cannot be exercised on CPU-only CI.
"""

from __future__ import annotations

import functools
import warnings
from abc import ABC, abstractmethod
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.errors import LlmoptError
from llmopt.layers.kernel_linear import KernelLinear
from llmopt.quant import int8_kernel
from llmopt.quant.fp8 import FP8_E4M3_MAX
from llmopt.quant.packing import pack_int32, unpack_int32
from llmopt.quant.qtensor import QuantizedWeight, identity_g_idx

INT4_KERNEL_GROUPS = (256, 128, 64, 32)
_FP8_DECODE_ELEMS = 1 << 20  # weights decoded per slab by the emulated fp8 path


def _device(qw: QuantizedWeight, device: torch.device | str | None) -> torch.device:
    return torch.device(device) if device is not None else qw.q.device


def _compute_dtype(compute_dtype: torch.dtype | None) -> torch.dtype:
    """bf16 unless asked otherwise: the int4 kernels want it (CUDA requires it, CPU is fastest)."""
    return compute_dtype if compute_dtype is not None else torch.bfloat16


class _QuantLinear(nn.Module):
    """Shared plumbing: shapes, bias, dtype casts, memory accounting."""

    mode: str

    def __init__(
        self, in_features: int, out_features: int, bias: torch.Tensor | None, compute_dtype: torch.dtype
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype
        if bias is not None:
            if tuple(bias.shape) != (out_features,):
                raise LlmoptError(f"bias shape {tuple(bias.shape)} != ({out_features},)")
            self.register_buffer("bias", bias.detach().clone())
        else:
            self.bias = None
        self._device_type = "cpu"

    @classmethod
    def _create(cls, qw: QuantizedWeight, bias: torch.Tensor | None, compute_dtype: torch.dtype | None,
                device: torch.device | str | None):
        """An empty module of qw's shape on `device` (default: qw's), and qw moved there."""
        dev = _device(qw, device)
        qw = qw.to(dev)
        m = cls(qw.in_features, qw.out_features, None if bias is None else bias.to(dev),
                _compute_dtype(compute_dtype))
        m._device_type = dev.type
        return m, qw

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise LlmoptError(
                f"{type(self).__name__} expects {self.in_features} input features, got {x.shape[-1]}"
            )
        if self.mode != "dequant" and x.device.type != self._device_type:
            raise LlmoptError(
                f"{type(self).__name__} was packed for {self._device_type}, got input on {x.device.type}; "
                "rebuild it with from_quantized(..., device=...)"
            )
        return x.reshape(-1, self.in_features).to(self.compute_dtype)

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if y.shape[-1] != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def weight_nbytes(self) -> int:
        """Bytes held for the weight (every buffer but the bias)."""
        return sum(b.numel() * b.element_size() for n, b in self.named_buffers() if n != "bias")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"mode={self.mode}, compute_dtype={self.compute_dtype}"
        )

    def _self_check(self, qw: QuantizedWeight) -> bool:
        """On accelerators: does the kernel agree with F.linear on the dequantized weight?"""
        dev = next(b for n, b in self.named_buffers() if n != "bias").device
        x = torch.randn(4, self.in_features, device=dev).to(self.compute_dtype)
        ref = F.linear(x.float(), qw.dequantize().to(dev))
        try:
            got = self._forward_kernel(x).float()[:, : self.out_features]
        except RuntimeError as e:
            warnings.warn(
                f"{type(self).__name__}: kernel failed on {dev} ({e}); using dequant fallback", stacklevel=3
            )
            return False
        err = (got - ref).norm() / ref.norm().clamp(min=1e-6)
        if err > 2e-2:
            warnings.warn(
                f"{type(self).__name__}: kernel mismatch {err:.3g} on {dev}; using dequant fallback",
                stacklevel=3,
            )
            return False
        return True

    def _forward_kernel(self, x2: torch.Tensor) -> torch.Tensor:
        raise LlmoptError(f"{type(self).__name__} has no kernel path")


class _IntLinear(_QuantLinear, ABC):
    """An integer weight of one width (`bits`), built into the subclass's layout by `_build`."""

    bits: int

    @classmethod
    def from_quantized(
        cls,
        qw: QuantizedWeight,
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Self:
        if qw.scheme.kind != "int" or qw.scheme.bits != cls.bits:
            raise LlmoptError(f"{cls.__name__} needs an int{cls.bits} weight, got {qw.scheme.describe()}")
        m, qw = cls._create(qw, bias, compute_dtype, device)
        m._build(qw)
        return m

    @abstractmethod
    def _build(self, qw: QuantizedWeight) -> None:
        """Register the buffers this class runs `qw` from, and set `mode`."""


class Int4WeightOnlyLinear(_IntLinear):
    """Grouped int4 weights (sym or asym) on the tinygemm int4 kernels; see module doc."""

    bits = 4

    def _build(self, qw: QuantizedWeight) -> None:
        N, K, gs = self.out_features, self.in_features, qw.group_size
        self.group_size = gs
        q, scale, zero, g_idx = qw.q, qw.scale.float(), qw.zero_points().float(), qw.g_idx
        perm = None
        if qw.is_act_order:
            order = torch.argsort(g_idx.long(), stable=True)
            if torch.equal(g_idx[order], identity_g_idx(K, gs, g_idx.device)):
                perm = order
        if self._build_vnni(qw, perm):
            return
        kg = next((g for g in INT4_KERNEL_GROUPS if gs % g == 0), None)
        usable = kg is not None and (perm is not None or not qw.is_act_order)
        if usable and self._device_type in ("cpu", "cuda"):
            if perm is not None:
                q = q[:, perm]
            reps = gs // kg
            s = scale.repeat_interleave(reps, dim=1)  # [N, K/kg]
            z = zero.repeat_interleave(reps, dim=1)
            n_pad = -(-N // 16) * 16
            qi = q.to(torch.int32)
            if n_pad != N:
                qi = F.pad(qi, (0, 0, 0, n_pad - N), value=8)
                s = F.pad(s, (0, 0, 0, n_pad - N))
                z = F.pad(z, (0, 0, 0, n_pad - N), value=8)
            sz = torch.stack([s, (8 - z) * s], dim=-1).transpose(0, 1).contiguous()  # [K/kg, Npad, 2]
            self.kernel_group_size = kg
            self.inner_k_tiles = 8 if K % 128 == 0 else 4 if K % 64 == 0 else 2
            if self._device_type == "cpu":
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qi, self.inner_k_tiles)
            else:
                u8 = ((qi[:, 0::2] << 4) | qi[:, 1::2]).to(torch.uint8)
                packed = torch.ops.aten._convert_weight_to_int4pack(u8, self.inner_k_tiles)
            self.register_buffer("packed", packed)
            self.register_buffer("scales_and_zeros", sz.to(self.compute_dtype))
            self.register_buffer("perm", None if perm is None else perm.to(torch.int32))
            self.mode = f"{self._device_type}-int4pack"
            if self._device_type == "cpu" or self._self_check(qw):
                return
            for name in ("packed", "scales_and_zeros", "perm"):
                delattr(self, name)
        # dequant fallback: nibble-packed codes, any g_idx
        self.mode = "dequant"
        self.register_buffer("qpacked", pack_int32(qw.q, 4, dim=1))
        self.register_buffer("scale", qw.scale.float())
        self.register_buffer("zero", None if qw.zero is None else qw.zero.clone())
        self.register_buffer("g_idx", qw.g_idx.clone() if qw.is_act_order else None)

    def _build_vnni(self, qw: QuantizedWeight, perm: torch.Tensor | None) -> bool:
        """Our CPU kernel's layout (module doc) where it applies; False leaves the other paths to `_build`."""
        from llmopt.layers.packed_linear import pack_int4_vnni, vnni_kernel

        gs, K = qw.group_size, self.in_features
        if (self._device_type != "cpu" or self.compute_dtype != torch.bfloat16 or qw.zero is not None
                or (qw.is_act_order and perm is None) or gs % 2 or K % gs):
            return False
        kernel = vnni_kernel()
        if kernel is None:
            return False
        q = qw.q if perm is None else qw.q[:, perm]
        packed, gscale = pack_int4_vnni(q, qw.scale.float())
        self.register_buffer("packed", packed)
        self.register_buffer("gscale", gscale)
        self.register_buffer("perm", None if perm is None else perm.to(torch.int32))
        self.kernel_group_size = gs
        self._vnni = kernel
        # the kernel adds the bias before its one rounding to bf16 (as in the decode step, which reads this)
        self.kernel_bias = None if self.bias is None else self.bias.to(torch.bfloat16).contiguous()
        self.mode = "cpu-vnni-int4"
        return True

    def _forward_kernel(self, x2: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self.mode == "cpu-vnni-int4":
            return self._vnni.int4(x2.contiguous(), self.packed, self.gscale, self.kernel_group_size, bias,
                                   self.out_features)
        if self._device_type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.packed, self.kernel_group_size, self.scales_and_zeros
            )
        return torch.ops.aten._weight_int4pack_mm(
            x2, self.packed, self.kernel_group_size, self.scales_and_zeros
        )

    def _dequant_fallback(self, dtype: torch.dtype) -> torch.Tensor:
        q = unpack_int32(self.qpacked, 4, dim=1, count=self.in_features).to(torch.int32)
        g = (
            self.g_idx.long()
            if self.g_idx is not None
            else torch.arange(self.in_features, device=q.device) // self.group_size
        )
        z = self.zero.to(torch.int32)[:, g] if self.zero is not None else 8
        return ((q - z).float() * self.scale[:, g]).to(dtype)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] this module effectively multiplies by (incl. kernel rounding)."""
        if self.mode == "dequant":
            return self._dequant_fallback(torch.float32)
        dev = self.packed.device
        eye = torch.eye(self.in_features, device=dev, dtype=self.compute_dtype)
        # row i of eye·Wᵀ is column i of W; with act-order the kernel's own permutation of x's
        # columns maps it back to the original column order
        return self._forward_kernel(eye).float()[:, : self.out_features].t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = self._prepare(x)
        if self.mode == "cpu-vnni-int4":
            y = self._forward_kernel(x2, self.kernel_bias)
            return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if self.mode == "dequant":
            y = F.linear(x2, self._dequant_fallback(self.compute_dtype))
        else:
            y = self._forward_kernel(x2)
        return self._finish(y, x)

    def kernel_linear(self) -> KernelLinear | None:
        if self.mode != "cpu-vnni-int4":
            return None
        return KernelLinear("int4", self.packed, self.in_features, self.out_features, scale=self.gscale,
                            bias=self.kernel_bias, group=self.kernel_group_size, perm=self.perm,
                            amx_min_rows=self._vnni.amx_from_rows(self.in_features, torch.uint8))


class Int8WeightOnlyLinear(_IntLinear):
    """int8 weights; per-channel on a kernel (see module doc), anything else dequantized per call."""

    bits = 8

    _native = True  # False (enforce_eager): decode-size batches on torch's kernel instead of ours
    _decode_kernel: int8_kernel.Int8LinearKernel | bool | None = None  # None: not resolved yet; False: none

    @property
    def native_kernel(self) -> bool:
        return self._native

    @native_kernel.setter
    def native_kernel(self, on: bool) -> None:
        self._native, self._decode_kernel = on, None

    def _build(self, qw: QuantizedWeight) -> None:
        K = self.in_features
        self.register_buffer("weight", (qw.q.to(torch.int16) - 128).to(torch.int8))
        zero = None if qw.zero is None else (qw.zero.to(torch.int16) - 128).to(torch.int8)
        kernel_ok = qw.n_groups == 1 and (self.compute_dtype != torch.bfloat16 or K % 16 == 0)
        if kernel_ok:
            s = qw.scale[:, 0].float()
            self.register_buffer("scales", s.to(self.compute_dtype))
            self.register_buffer("zero_corr", None if zero is None else zero.float()[:, 0] * s)
            self.mode = f"{self._device_type}-int8"
            if self._device_type == "cpu" or self._self_check(qw):
                return
            for name in ("scales", "zero_corr"):
                delattr(self, name)
        self.mode = "dequant"
        self.register_buffer("scale", qw.scale.float())
        self.register_buffer("zero", zero)
        self.register_buffer("g_idx", qw.g_idx.clone())

    def _forward_kernel(self, x2: torch.Tensor) -> torch.Tensor:
        y = self._cpu_matmul(x2) if self._device_type == "cpu" else torch.ops.aten._weight_int8pack_mm(
            x2, self.weight, self.scales)
        if self.zero_corr is not None:
            y = (y.float() - x2.float().sum(1, keepdim=True) * self.zero_corr[None, :]).to(y.dtype)
        return y

    def _cpu_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """Decode-size batches: our int8 kernel (torch's `_weight_int8pack_mm` when it cannot be built, or
        with `native_kernel` off); bigger ones: the weight dequantized to x's dtype (by the kernel's library,
        else torch) and one dense matmul, faster than either kernel past MAX_ROWS rows
        (docs/BENCHMARKS.md, "int8 decode kernel")."""
        kernel = int8_kernel.load() if self.native_kernel else None
        if kernel is not None and not kernel.supports(x2, self.weight, self.scales):
            kernel = None
        if x2.shape[0] > int8_kernel.MAX_ROWS:
            w = kernel.dequantize(self.weight, self.scales) if kernel else torch.mul(self.weight, self.scales[:, None])
            return F.linear(x2, w)
        if kernel is not None:
            return kernel(x2, self.weight, self.scales)
        return torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] this module multiplies by."""
        if self.mode == "dequant":
            g = self.g_idx.long()
            z = self.zero.float()[:, g] if self.zero is not None else 0.0
            return (self.weight.float() - z) * self.scale[:, g]
        w = self.weight.float() * self.scales.float()[:, None]
        if self.zero_corr is not None:
            w = w - self.zero_corr[:, None]
        return w

    def _resolve_decode_kernel(self) -> int8_kernel.Int8LinearKernel | bool:
        """Our kernel, when this module's decode-size matmuls can go straight to it (CPU, per-channel,
        no bias or zero point; x checked per call); False otherwise. Resolved once: a decode step calls
        this module's forward per layer, and the general path's checks cost as much as a small matmul."""
        kernel = int8_kernel.load() if self._native and self.mode == "cpu-int8" else None
        ok = (kernel is not None and self.bias is None and self.zero_corr is None
              and kernel.takes(self.weight, self.scales))
        self._decode_kernel = kernel if ok else False
        return self._decode_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self._decode_kernel
        if kernel is None:
            kernel = self._resolve_decode_kernel()
        if (kernel and x.is_cpu and x.dim() == 2 and x.shape[0] <= int8_kernel.MAX_ROWS
                and x.dtype == self.compute_dtype and x.shape[1] == self.in_features and x.is_contiguous()):
            return kernel(x, self.weight, self.scales)
        x2 = self._prepare(x)
        if self.mode == "dequant":
            g = self.g_idx.long()
            w = self.weight.to(torch.int16)
            if self.zero is not None:
                w = w - self.zero.to(torch.int16)[:, g]
            w = w.to(self.compute_dtype) * self.scale[:, g].to(self.compute_dtype)
            y = F.linear(x2, w)
        else:
            y = self._forward_kernel(x2)
        return self._finish(y, x)


class Fp8WeightOnlyLinear(_QuantLinear):
    """float8_e4m3fn weights with per-output-channel scales; see module doc for the two modes."""

    @classmethod
    def from_quantized(
        cls,
        qw: QuantizedWeight,
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        activation_fp8: bool = False,
    ) -> Fp8WeightOnlyLinear:
        if qw.scheme.kind != "fp8":
            raise LlmoptError(f"Fp8WeightOnlyLinear needs an fp8 weight, got {qw.scheme.describe()}")
        m, qw = cls._create(qw, bias, compute_dtype, device)
        m.register_buffer("weight", qw.q.contiguous())
        m.register_buffer("scale", qw.scale.float().reshape(-1))
        m.mode = "dequant"
        if activation_fp8:
            m.mode = "scaled_mm"
            if m._device_type != "cpu" and not m._self_check_fp8(qw):
                m.mode = "dequant"
        return m

    def _self_check_fp8(self, qw: QuantizedWeight) -> bool:
        try:
            self._forward_kernel(
                torch.randn(16, self.in_features, device=self.weight.device).to(self.compute_dtype)
            )
        except RuntimeError as e:
            warnings.warn(
                f"torch._scaled_mm unavailable on {self.weight.device} ({e}); emulating fp8", stacklevel=3
            )
            return False
        return True

    def _forward_kernel(self, x2: torch.Tensor) -> torch.Tensor:
        xs = (x2.float().abs().amax(1, keepdim=True) / FP8_E4M3_MAX).clamp(min=1e-12)
        xq = (x2.float() / xs).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return torch._scaled_mm(
            xq, self.weight.t(), scale_a=xs, scale_b=self.scale[None, :], out_dtype=self.compute_dtype
        )

    def _forward_emulated(self, x2: torch.Tensor) -> torch.Tensor:
        """Decode fp8 through a 256-entry table (~6x faster than `.to()` on CPU) a slab of output
        channels at a time (bounded transient memory), scaling the [M, N] output, not the weight."""
        table = _fp8_table(self.compute_dtype, self.weight.device)
        codes = self.weight.view(torch.uint8)
        y = torch.empty(x2.shape[0], self.out_features, dtype=self.compute_dtype, device=x2.device)
        rows = max(1, _FP8_DECODE_ELEMS // self.in_features)
        for start in range(0, self.out_features, rows):
            c = codes[start : start + rows]
            w = table.index_select(0, c.reshape(-1).to(torch.int32)).view(c.shape)
            y[:, start : start + c.shape[0]] = x2 @ w.t()
        return y * self.scale.to(self.compute_dtype)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = self._prepare(x)
        if self.mode == "scaled_mm":
            y = self._forward_kernel(x2)
        else:
            y = self._forward_emulated(x2)
        return self._finish(y, x)


@functools.lru_cache(maxsize=8)
def _fp8_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Value of each float8_e4m3fn bit pattern in `dtype` (NaN patterns are never produced)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(dtype).to(device)


def use_native_int8_kernel(model: nn.Module, on: bool) -> int:
    """Turn our int8 decode kernel on or off in every `Int8WeightOnlyLinear` of `model`; returns how many."""
    mods = [m for m in model.modules() if isinstance(m, Int8WeightOnlyLinear)]
    for m in mods:
        m.native_kernel = on
    return len(mods)


def quantized_linear(
    qw: QuantizedWeight,
    bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """The runtime module for `qw`'s scheme (int4 → Int4, int8 → Int8, fp8 → Fp8 weight-only)."""
    if qw.scheme.kind == "fp8":
        return Fp8WeightOnlyLinear.from_quantized(qw, bias, compute_dtype, device)
    if qw.scheme.bits == 4:
        return Int4WeightOnlyLinear.from_quantized(qw, bias, compute_dtype, device)
    return Int8WeightOnlyLinear.from_quantized(qw, bias, compute_dtype, device)
