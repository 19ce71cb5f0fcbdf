"""Which implementation runs the element-wise functions (RMSNorm, RoPE, act·up) and prefill attention; none
wins at every size (docs/BENCHMARKS.md). `Ops.NATIVE` (`native_ops.c`): bf16 CPU steps under `MIN_TOKENS`
(decode); `Ops.COMPILED` (TorchInductor): bigger bf16/fp16 CPU steps, except the functions marked
`native_below` (RoPE, GELU·up; the norms and SiLU·up under 512 rows), whose native versions were measured
faster there; else `Ops.EAGER`, always in fp32 so greedy fp32 output stays token-identical to transformers.
The others are tested against the eager function, and fall back to it when they cannot be built here."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

import torch

from llmopt.layers import native_ops

log = logging.getLogger(__name__)

MIN_TOKENS = 64  # smallest step (tokens) that runs the compiled functions; smaller bf16 steps run native ones
# rows under which the native norms and SiLU·up beat TorchInductor's in compiled steps too (from 1,024 rows the two
# are within 25% of each other either way, inductor's ahead at the wider shapes; RoPE's and GELU·up's native versions
# win at every size): docs/BENCHMARKS.md, "Prefill on the Intel Xeon VM"
NATIVE_PREFILL_ROWS = 512

_compiled: dict[Callable, Callable] = {}
_broken: list[str] = []
_native: dict[Callable, str] = {}  # eager function -> the `native_ops.NativeOps` method that replaces it
_native_below: dict[Callable, float] = {}  # function -> rows under which its native version runs compiled steps too


class Ops(enum.Enum):
    EAGER = "eager"
    NATIVE = "native"  # llmopt.layers.native_ops
    COMPILED = "compiled"  # torch.compile (TorchInductor)


def has_native(fn: Callable) -> Callable:
    """`fn` has a `native_ops.NativeOps` method of the same name and signature, which `Ops.NATIVE` runs."""
    _native[fn] = fn.__name__
    return fn


def native_below(rows: float) -> Callable[[Callable], Callable]:
    """Decorator: `fn`'s native version runs `Ops.COMPILED` calls too while x has fewer than `rows` rows
    (`math.inf`: at every size), where it was measured faster than TorchInductor's (docs/BENCHMARKS.md,
    "Prefill on the Intel Xeon VM"); at and past `rows`, and wherever it declines the input, inductor's."""
    def mark(fn: Callable) -> Callable:
        assert fn in _native, f"{fn.__name__} has no native version"
        _native_below[fn] = rows
        return fn
    return mark


def available() -> bool:
    """False once a compilation has failed in this process."""
    return not _broken


def call(ops: Ops, fn: Callable, *args):
    """`fn(*args)`, run by the implementation `ops` names where it has one for `fn` and these args."""
    if ops is Ops.NATIVE or (ops is Ops.COMPILED and args[0].shape[0] < _native_below.get(fn, 0)):
        name = _native.get(fn)
        lib = native_ops.load() if name is not None else None
        out = getattr(lib, name)(*args) if lib is not None else None
        if out is not None:
            return out
    if ops is Ops.COMPILED and not _broken:  # also where the native version declined the input
        try:
            if fn not in _compiled:
                _compiled[fn] = torch.compile(fn, dynamic=True)
            with _no_duck_shapes():
                return _compiled[fn](*args)
        except Exception as e:  # inductor fails with many exception types (compiler missing, lowering)
            msg = str(e).strip().splitlines()
            _broken.append(f"{type(e).__name__}: {msg[0] if msg else ''}")
            log.warning("compiled kernels unavailable (%s); running eagerly", _broken[0])
    return fn(*args)


def _no_duck_shapes():
    """Trace without duck sizing: by default dynamo assumes two sizes (or a size and a stride) that were
    equal on the first call stay equal, and recompiles when a later step's shapes differ (a prefill chunk
    whose context equals its length, then one over a cached prefix): a few seconds of compile in the
    middle of serving, for each such pair."""
    return torch.fx.experimental._config.patch(use_duck_shape=False)


def choose(dtype: torch.dtype, device: torch.device, num_tokens: int) -> Ops:
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return Ops.EAGER
    if num_tokens >= MIN_TOKENS:
        return Ops.COMPILED if available() else Ops.EAGER
    return Ops.NATIVE if dtype == torch.bfloat16 else Ops.EAGER
