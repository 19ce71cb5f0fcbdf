"""Dense bf16/fp16 CPU projections with the weight packed once (decode reads every weight per token, and
CPU `F.linear` is far from memory speed at a few rows): our kernel (`bf16_linear.c`) over VNNI pairs for
bf16 with AVX512-BF16 or AVX2, else oneDNN's blocked layout. Both sum in float32 and round once; fp32 is never
packed, so greedy fp32 output stays token-identical to transformers. A tied lm_head gets a packed copy and
the embedding keeps the plain weight for lookups, as vLLM does (one more vocab x hidden matrix in memory)."""

from __future__ import annotations

import ctypes
import logging
import re
from pathlib import Path

import torch
from torch import nn

import llmopt.native as native
from llmopt.devices import onednn_supported
from llmopt.layers.kernel_linear import KernelLinear
from llmopt.layers.linear import FusedLinear, set_submodule

log = logging.getLogger(__name__)

PACKED_DTYPES = (torch.bfloat16, torch.float16)
_EXPERT = re.compile(r"(^|\.)experts\.\d+\.")  # a MoE expert's projection (SparseMoeBlock's naming)
SOURCE = Path(__file__).with_name("bf16_linear.c")
PANEL = 64  # outputs per panel of the VNNI layout (bf16_linear.c's PANEL)
INT4_AMX_ROWS = 6  # measured on SmolLM2 and 1.2B shapes, cold, against the float32 passes (docs/BENCHMARKS.md)
AMX_K = 32  # inputs per AMX tile row (bf16_linear.c's AMX_K): K must be a multiple of it for the AMX path
# rows from which AMX tiles run a call where the CPU has them (docs/BENCHMARKS.md, "AMX"): bf16 weights at every
# row count (even with one row AMX streams the weight as fast, and then every batch size rounds alike); int8
# weights widen a panel to bf16 first, which pays only past a few rows (measured with the weights cold, as in
# decode, on SmolLM2's and the 1.2B shapes); int4 panels (uint8 codes) are dequantized first, and below that many
# rows the int4 kernel's own passes (exact products, no widening) are faster
AMX_MIN_ROWS = {torch.bfloat16: 1, torch.int8: 5, torch.uint8: INT4_AMX_ROWS}
# Where native.fma_beats_vdpbf16ps(), the int8 and int4 passes multiply in float32 FMAs rather than vdpbf16ps
# (bf16_linear_set_fma): with the weights cold the passes of 1-5 rows ran 1.11-1.46x (int4) and 1.04-1.34x (int8)
# faster in FMAs on Intel cores (docs/BENCHMARKS.md, "float32 passes"); bf16 weights from 2 rows too, in
# vdpbf16ps's own order (1.03-1.46x at 2-512 rows on an Intel Xeon without AMX, "An Intel Xeon without AMX")


class Bf16LinearKernel:
    """The loaded `bf16_linear.c`; `available` is False where the build has neither AVX512-BF16 nor AVX2 with FMA
    (`isa` says which passes run), `amx` True where the CPU (and its kernel) lend AMX tiles, which then run every
    call of `amx_min_rows` rows or more."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        for fn in (lib.bf16_linear, lib.bf16_linear_amx):
            fn.argtypes = [ptr, i64, i64, ptr, ctypes.c_int, ptr, ptr, i64, ptr, ctypes.c_int]
            fn.restype = ctypes.c_int
        for fn in (lib.bf16_linear_int4, lib.bf16_linear_int4_amx):
            fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, ptr, ctypes.c_int]
            fn.restype = ctypes.c_int
        self._int4, self._int4_amx = lib.bf16_linear_int4, lib.bf16_linear_int4_amx
        self.available = bool(lib.bf16_linear_available())
        # 2: AVX512-BF16 passes (and AMX where lent), 1: AVX2 float32 passes, 0: neither (a library built before the
        # AVX2 passes has no bf16_linear_isa: then AVX512-BF16 or nothing)
        isa = getattr(lib, "bf16_linear_isa", None)
        self.isa = {2: "avx512-bf16", 1: "avx2"}.get(int(isa()) if isa is not None else 2 * self.available, "none")
        self._int4_widen_rows = getattr(lib, "bf16_linear_int4_widen_rows", None)
        self.amx = self.available and bool(lib.bf16_linear_amx_available())
        self.amx_min_rows = dict(AMX_MIN_ROWS)
        self._vnni, self._amx, self.path = lib.bf16_linear, lib.bf16_linear_amx, path
        # the library's switch (absent from a library built before it: then always off)
        self._set_fma, self._get_fma = getattr(lib, "bf16_linear_set_fma", None), getattr(lib, "bf16_linear_fma", None)
        self.fma = native.fma_beats_vdpbf16ps()

    @property
    def int4_widen_rows(self) -> int:
        """Past this many rows (off AMX) int4 panels are dequantized to bf16 first (torch's rounded (q - 8) * s):
        16 where the passes run FMAs (`fma`), 64 with vdpbf16ps; never on the AVX2 passes."""
        return int(self._int4_widen_rows()) if self._int4_widen_rows is not None else 64

    @property
    def fma(self) -> bool:
        """Whether the int8 and int4 passes off AMX (and bf16's from 2 rows) multiply in float32 FMAs (else
        vdpbf16ps); settable, for tests and benchmarks. Both meet the same float32-summation bound; int8's and int4's
        roundings differ, bf16's are the same (vdpbf16ps's order)."""
        return self._get_fma is not None and bool(self._get_fma())

    @fma.setter
    def fma(self, on: bool) -> None:
        if self._set_fma is not None:
            self._set_fma(int(on))

    def addresses(self) -> dict[str, int]:
        """The C functions' addresses, for callers that run them from C (llmopt/step/decode_step.c)."""
        return {name: ctypes.cast(fn, ctypes.c_void_p).value or 0
                for name, fn in (("linear", self._vnni), ("linear_amx", self._amx), ("linear_int4", self._int4),
                                 ("linear_int4_amx", self._int4_amx))}

    def uses_amx(self, m: int, k: int, weight_dtype: torch.dtype) -> bool:
        """Whether a call of m rows over k inputs (weights of `weight_dtype`: bf16, int8, or uint8 for int4
        panels) runs on AMX tiles, else on the VNNI kernel."""
        return self.amx and m >= self.amx_min_rows[weight_dtype] and k % AMX_K == 0

    def amx_from_rows(self, k: int, weight_dtype: torch.dtype) -> int:
        """The rows from which a call over k inputs runs on AMX tiles, or -1 where none does (what the C callers
        of the kernel, `KernelLinear.amx_min_rows`, decide by)."""
        return self.amx_min_rows[weight_dtype] if self.uses_amx(1 << 30, k, weight_dtype) else -1

    def __call__(self, x2: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
        """(x2 @ w.T) * scale + bias. x2 [M, K] bf16 contiguous; `packed`: pack_vnni of an [n, K] weight, bf16
        or int8 (then `scale` is required); scale and bias: [n] bf16 contiguous, or None."""
        m, k = x2.shape
        int8 = packed.dtype == torch.int8
        if int8 and scale is None:
            raise ValueError("bf16 linear kernel: int8 weights need their scales")
        out = torch.empty(m, n, dtype=torch.bfloat16)
        fn = self._amx if self.uses_amx(m, k, packed.dtype) else self._vnni
        rc = fn(x2.data_ptr(), m, k, packed.data_ptr(), int(int8), _ptr(scale), _ptr(bias), n, out.data_ptr(),
                torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("bf16 linear kernel: " + ("no AVX512-BF16 or AVX2 in this build" if rc == 1
                                                         else "out of memory"))
        return out


    def int4(self, x2: torch.Tensor, packed: torch.Tensor, gscale: torch.Tensor, group: int,
             bias: torch.Tensor | None, n: int) -> torch.Tensor:
        """x2 @ ((q - 8) * s).T + bias: x2 [M, K] bf16 contiguous; `packed` and `gscale` from pack_int4_vnni."""
        m, k = x2.shape
        out = torch.empty(m, n, dtype=torch.bfloat16)
        fn = self._int4_amx if self.uses_amx(m, k, torch.uint8) else self._int4
        rc = fn(x2.data_ptr(), m, k, packed.data_ptr(), gscale.data_ptr(), group, _ptr(bias), n, out.data_ptr(),
                torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("bf16 linear kernel (int4): " + {1: "no AVX512-BF16 or AVX2 in this build", 2: "out of memory",
                                                                 3: f"group {group} does not fit K {k}"}[rc])
        return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def vnni_kernel() -> Bf16LinearKernel | None:
    """Our bf16 kernel where it runs here, else None (after one warning if it could not be built)."""
    kernel = native.load(SOURCE, Bf16LinearKernel, "bf16 linears use oneDNN's packed weights")
    return kernel if kernel is not None and kernel.available else None


def pack_vnni(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] (K even) -> the flat VNNI layout of bf16_linear.c: N padded to 16 with zero rows, panels of
    PANEL outputs, each [K / 2][width][2]."""
    n, k = weight.shape
    n16 = n + -n % 16
    out = weight.new_zeros(n16 * k)  # written panel by panel: one copy of the weight, no intermediate ones
    for p0 in range(0, n, PANEL):
        width = min(PANEL, n16 - p0)
        rows = weight[p0:p0 + width]  # the last panel may lack its zero padding rows: they stay zero
        out[p0 * k:(p0 + width) * k].view(k // 2, width, 2)[:, :rows.shape[0]].copy_(
            rows.reshape(-1, k // 2, 2).transpose(0, 1))
    return out


def pack_int4_vnni(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 codes q [N, K] (0..15, the weight being (q - 8) * scale) and group scales [N, K / G] ->
    bf16_linear.c's int4 panels (uint8, one byte per output and pair of k: low nibble k, high k + 1) and the
    scales as flat bf16 panel by panel, each [K / G][width] (zero for the padding outputs): a pass reads its
    panel's scales in order, where rows of all N outputs put each group's scales a page or more apart (a
    demand miss per group, which the weight stream's prefetch never covers)."""
    n, k = q.shape
    n16 = n + -n % 16
    q8 = q.to(torch.uint8)
    pairs = q8[:, 0::2] | (q8[:, 1::2] << 4)  # [N, K / 2]
    out = torch.full((n16 * k // 2,), 0x88, dtype=torch.uint8)  # padding outputs: code 8, weight 0
    groups = scale.shape[1]
    gscale = torch.zeros(n16 * groups, dtype=torch.bfloat16)
    for p0 in range(0, n, PANEL):
        width = min(PANEL, n16 - p0)
        rows = pairs[p0:p0 + width]
        out[p0 * k // 2:(p0 + width) * k // 2].view(k // 2, width)[:, :rows.shape[0]].copy_(rows.t())
        gscale[p0 * groups:(p0 + width) * groups].view(groups, width)[:, :rows.shape[0]].copy_(
            scale[p0:p0 + width].t())
    return out, gscale


def unpack_vnni(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack_vnni's inverse: the [n, k] weight."""
    n16 = -(-n // 16) * 16
    panels = packed.split([min(PANEL, n16 - p) * k for p in range(0, n16, PANEL)])
    return torch.cat([p.view(k // 2, -1, 2).transpose(0, 1).reshape(-1, k) for p in panels])[:n]


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `pack_linears` will pack weights of `dtype` on `device` here: bf16 where our kernel runs (AVX2 is
    enough: on CPUs without AVX512-BF16, oneDNN has no bf16 matmul) or oneDNN has a bf16 matmul, fp16 where oneDNN
    has one."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES:
        return False
    return (dtype == torch.bfloat16 and vnni_kernel() is not None) or onednn_supported(dtype)


class PackedLinear(nn.Module):
    """`nn.Linear` whose only weight copy is packed: `weight` unpacks it (slow, for inspection), as does
    `state_dict()`. `vnni=False` keeps oneDNN's layout (the A/B in benchmarks)."""

    def __init__(self, linear: nn.Linear, vnni: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().contiguous()
        self.dtype = weight.dtype
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().contiguous(), requires_grad=False)
        ok = vnni and self.dtype == torch.bfloat16 and self.in_features % 2 == 0 and weight.device.type == "cpu"
        self.kernel = vnni_kernel() if ok else None
        if self.kernel is not None:
            self.packed = pack_vnni(weight)
        else:  # the batch size is a hint for the layout; decode batches are the ones the layout is for
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)

    @property
    def weight(self) -> torch.Tensor:
        if self.kernel is not None:
            return unpack_vnni(self.packed, self.out_features, self.in_features)
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        if self.kernel is not None:
            x2 = x.reshape(-1, self.in_features).contiguous()
            return self.kernel(x2, self.packed, self.bias, self.out_features).view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def kernel_linear(self) -> KernelLinear | None:
        if self.kernel is None:
            return None
        return KernelLinear("bf16", self.packed, self.in_features, self.out_features, bias=self.bias,
                            amx_min_rows=self.kernel.amx_from_rows(self.in_features, torch.bfloat16))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight

    def extra_repr(self) -> str:
        layout = "vnni" if self.kernel is not None else "onednn"
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, {layout}"


def pack_linears(model: nn.Module, under: str | None = None) -> int:
    """Swap every plain dense bf16/fp16 CPU Linear of `model` (or of its module `under`, the loader packing one
    layer at a time) for a PackedLinear; returns how many. Quantized modules and linears with hooks are kept. MoE
    experts are packed where our bf16 kernel runs them (their block is then one C call, `moe_native.py`), and
    kept plain elsewhere, for the block's grouped_mm over their stacked weights."""
    vnni = vnni_kernel() is not None
    names = [name for name, mod in model.named_modules()
             if type(mod) in (nn.Linear, FusedLinear) and not mod._forward_hooks and not mod._forward_pre_hooks
             and not mod.weight.is_meta and packing_supported(mod.weight.dtype, mod.weight.device)
             and (not _EXPERT.search(name) or (vnni and mod.weight.dtype == torch.bfloat16))
             and (under is None or name == under or name.startswith(under + "."))]
    for i, name in enumerate(names):  # by name, so each plain weight is freed once its packed copy is in
        try:
            packed = PackedLinear(model.get_submodule(name))
        except RuntimeError as e:  # a torch build whose oneDNN lacks the reorder for this dtype
            log.warning("weights stay unpacked (%s)", str(e).splitlines()[0] if str(e) else type(e).__name__)
            return i
        set_submodule(model, name, packed)  # keeps a fused projection's output_splits
    return len(names)
