"""A decode step's program: the ops `decode_step.c` runs, in order, over buffers allocated once for up to
`rows` tokens. A family's lowering (`lowering.py`) appends ops through `Program`'s methods, which mirror the
eager layer functions one for one; the buffers are named so a lowering reads like the layer's `forward`."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from llmopt.layers.attention.paged_decode_kernel import CODES
from llmopt.layers.kernel_linear import KernelLinear
from llmopt.layers.moe_native import NativeMoe

# decode_step.c's enum
OP_NORM, OP_HEAD_NORM, OP_LINEAR, OP_GATHER_COLS, OP_ROTARY, OP_KV_WRITE, OP_ATTEND, OP_ACT, OP_COPY_COLS, OP_MOE = range(10)
OP_NAMES = ("norm", "head_norm", "linear", "gather_cols", "rotary", "kv_write", "attend", "act", "copy_cols", "moe")


class Op(ctypes.Structure):
    """decode_step.c's op_t (the meaning of each field per kind is in that file)."""

    _fields_ = [("kind", ctypes.c_int32), ("i", ctypes.c_int32 * 3), ("n", ctypes.c_int64 * 6),
                ("f", ctypes.c_float * 2), ("p", ctypes.c_void_p * 6), ("a", ctypes.c_void_p),
                ("b", ctypes.c_void_p), ("out", ctypes.c_void_p)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass
class Buffer:
    """A [rows, width] bf16 activation buffer; `offset` elements into its rows for views of it (the k heads
    of a fused q|k row)."""

    tensor: torch.Tensor
    offset: int = 0

    @property
    def width(self) -> int:
        return self.tensor.shape[1]

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr() + 2 * self.offset

    def at(self, offset: int) -> Buffer:
        return Buffer(self.tensor, self.offset + offset)


@dataclass
class Program:
    """Ops over activation buffers of `rows` rows (`tensors` keeps every pointer the ops hold alive)."""

    rows: int
    ops: list[Op] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    keep: list[object] = field(default_factory=list)  # other objects the ops point into (MoE specs)
    _buffers: dict[str, Buffer] = field(default_factory=dict)

    def buffer(self, name: str, width: int) -> Buffer:
        """The named buffer, allocated on first use ([rows, width] bf16); a later use must agree on width."""
        buf = self._buffers.get(name)
        if buf is None:
            buf = self._buffers[name] = Buffer(torch.zeros(self.rows, width, dtype=torch.bfloat16))
        elif buf.width != width:
            raise ValueError(f"buffer {name!r} is {buf.width} wide, not {width}")
        return buf

    def _op(self, kind: int, a: Buffer | None, out: Buffer | None, *, b: Buffer | None = None,
            i: tuple[int, ...] = (), n: tuple[int, ...] = (), f: tuple[float, ...] = (),
            p: tuple[torch.Tensor | None, ...] = ()) -> None:
        op = Op(kind=kind, a=a.ptr if a else None, b=b.ptr if b else None, out=out.ptr if out else None)
        op.i[:len(i)], op.n[:len(n)], op.f[:len(f)] = i, n, f
        op.p[:len(p)] = [_ptr(t) for t in p]
        self.tensors += [t for t in p if t is not None]
        self.ops.append(op)

    def norm(self, x: Buffer, weight: torch.Tensor, eps: float, offset: bool, out: Buffer,
             residual: Buffer | None = None) -> None:
        """out = norm(x), or with `residual`: residual += x (rounded to bf16), out = norm(residual)."""
        self._op(OP_NORM, x, out, b=residual, i=(int(offset),), n=(x.width, out.width), f=(eps,), p=(weight,))

    def head_norm(self, x: Buffer, heads: int, head_dim: int, weight: torch.Tensor, eps: float, offset: bool,
                  out: Buffer) -> None:
        """Per-head norm of `heads` heads starting at `x`'s offset, into `out` at its offset."""
        self._op(OP_HEAD_NORM, Buffer(x.tensor), Buffer(out.tensor), i=(int(offset),),
                 n=(x.width, head_dim, x.offset, out.width, out.offset, heads), f=(eps,), p=(weight,))

    def linear(self, x: Buffer, w: KernelLinear | list[KernelLinear], out: Buffer) -> None:
        """out = x @ W^T; a list: the parts of a fused projection (a ConcatLinear), each into its columns."""
        if isinstance(w, list):
            col = 0
            for part in w:
                scratch = self.buffer(f"part{part.out_features}", part.out_features)
                self.linear(x, part, scratch)
                self._op(OP_COPY_COLS, scratch, out, n=(part.out_features, out.width, col))
                col += part.out_features
            return
        if w.perm is not None:
            gathered = self.buffer(f"gathered{w.in_features}", w.in_features)
            self._op(OP_GATHER_COLS, x, gathered, n=(w.in_features,), p=(w.perm,))
            x = gathered
        self._op(OP_LINEAR, x, out, i=(w.code,),
                 n=(w.in_features, w.out_features, w.group, w.amx_min_rows), p=(w.packed, w.scale, w.bias))

    def rotary(self, x: Buffer, heads: int, head_dim: int, rope_set: int, out: Buffer) -> None:
        self._op(OP_ROTARY, x, out, i=(rope_set,), n=(x.width, heads, head_dim))

    def kv_write(self, k: Buffer, v: Buffer, pool, layer: int, kv_group: int) -> None:
        """K rows of `k` and V rows of `v` into layer `layer` of `pool` (a PagedKVCache) at the slots of KV
        group `kv_group`: copied, or for an int8 / fp8 pool quantized as PagedKVCache.write does (its
        calibrated static scales, if set by now, are read from where they are)."""
        k_pool = pool.k[layer]
        hkv, slots, d = k_pool.shape
        codes = CODES[pool.codes]
        static = ((pool.static_k_scale[layer], pool.static_v_scale[layer]) if codes and pool.static_k_scale is not None
                  else (None, None))
        self._op(OP_KV_WRITE, k, None, b=v, i=(kv_group, codes), n=(k.width, v.width, hkv, d, slots),
                 p=(k_pool, pool.v[layer], *pool.scales(layer), *static))

    def attend(self, q: Buffer, num_heads: int, pool, layer: int, block_size: int, kv_group: int, window: int,
               scale: float, out: Buffer) -> None:
        """Paged decode attention of the q heads in `q` over layer `layer` of `pool` (bf16, int8 or fp8)."""
        k_pool = pool.k[layer]
        hkv, slots, d = k_pool.shape
        scratch = self.buffer(f"q{num_heads * d}", num_heads * d).tensor
        self._op(OP_ATTEND, q, out, i=(kv_group, window, CODES[pool.codes]),
                 n=(q.width, num_heads, hkv, d, slots, block_size), f=(scale,),
                 p=(k_pool, pool.v[layer], scratch, *pool.scales(layer)))

    def act(self, x: Buffer, intermediate: int, gelu: bool, out: Buffer) -> None:
        self._op(OP_ACT, x, out, i=(int(gelu),), n=(intermediate,))

    def moe(self, x: Buffer, block: NativeMoe, out: Buffer) -> None:
        """out = the sparse MoE block `block` (its C spec) over x; the spec stays alive with the program. The
        step leaves the block's `last_counts` as they were (no tokens-per-expert output)."""
        self.keep.append(block)
        self._op(OP_MOE, x, out)
        self.ops[-1].p[0] = block.address

    def array(self, start: int = 0, end: int | None = None) -> ctypes.Array:
        ops = self.ops[start:end]
        return (Op * len(ops))(*ops)
