"""Which implementation a step runs the layers' element-wise functions (RMSNorm, RoPE, act·up) and its
prefill attention with: eager torch, our C kernels, or TorchInductor's.

Why: in eager mode those functions are ~35 small torch ops per layer, each with its own dispatch and
dtype casts. That fixed cost dominates small steps and the passes over memory dominate big ones, and no
single implementation wins both (docs/BENCHMARKS.md):
- `Ops.NATIVE`, bf16 CPU steps under `MIN_TOKENS` tokens (decode): one ctypes call per function into
  `native_ops.c`, cheaper than the eager ops it replaces;
- `Ops.COMPILED`, bf16/fp16 CPU steps of at least `MIN_TOKENS` (prefill): each function compiled by
  TorchInductor into one fused loop (dynamic shapes, once per process and dtype), and causal attention
  as two bf16 matmuls around one fused mask+softmax. A compiled call costs more than the eager ops at
  decode sizes;
- `Ops.EAGER` otherwise, and always in fp32, so greedy fp32 output stays token-identical to
  transformers (a fused kernel rounds differently), and with `enforce_eager`.

The eager function stays the definition: the others are checked against it. When one cannot be built
here (no C compiler, say), the failure is logged once and the eager function runs instead.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

import torch

from llmopt.layers import native_ops

log = logging.getLogger(__name__)

MIN_TOKENS = 64  # smallest step (tokens) that runs the compiled functions; smaller bf16 steps run native ones

_compiled: dict[Callable, Callable] = {}
_broken: list[str] = []
_native: dict[Callable, str] = {}  # eager function -> the `native_ops.NativeOps` method that replaces it


class Ops(enum.Enum):
    EAGER = "eager"
    NATIVE = "native"  # llmopt.layers.native_ops
    COMPILED = "compiled"  # torch.compile (TorchInductor)


def has_native(fn: Callable) -> Callable:
    """Decorator for an eager function that `native_ops.NativeOps` replaces with a method of the same
    name and signature; `Ops.NATIVE` runs only functions declared so."""
    _native[fn] = fn.__name__
    return fn


def available() -> bool:
    """False once a compilation has failed in this process."""
    return not _broken


def call(ops: Ops, fn: Callable, *args):
    """`fn(*args)`, run by the implementation `ops` names where it has one for `fn` and these args."""
    if ops is Ops.NATIVE:
        name = _native.get(fn)
        lib = native_ops.load() if name is not None else None
        out = getattr(lib, name)(*args) if lib is not None else None
        if out is not None:
            return out
    elif ops is Ops.COMPILED and not _broken:
        try:
            if fn not in _compiled:
                _compiled[fn] = torch.compile(fn, dynamic=True)
            return _compiled[fn](*args)
        except Exception as e:  # inductor fails with many exception types (compiler missing, lowering)
            msg = str(e).strip().splitlines()
            _broken.append(f"{type(e).__name__}: {msg[0] if msg else ''}")
            log.warning("compiled kernels unavailable (%s); running eagerly", _broken[0])
    return fn(*args)


def choose(dtype: torch.dtype, device: torch.device, num_tokens: int) -> Ops:
    """The implementation for a step of `num_tokens` in `dtype` on `device` (see the module doc)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return Ops.EAGER
    if num_tokens >= MIN_TOKENS:
        return Ops.COMPILED if available() else Ops.EAGER
    return Ops.NATIVE if dtype == torch.bfloat16 else Ops.EAGER
