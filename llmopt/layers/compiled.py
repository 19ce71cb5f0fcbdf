"""TorchInductor-compiled versions of the layers' own element-wise and prefill-attention functions, for
big token batches in bf16/fp16 on CPU.

Why: in eager mode RMSNorm, RoPE and SiLU·up are ~25 small ops per layer, each a full pass over the
activations with its own dtype casts, and CPU SDPA runs at ~40 GFLOP/s in bf16. Compiled, each function
is one fused loop, and causal attention becomes two bf16 matmuls around one fused mask+softmax. On the
mixed offline workload this cut prefill step time by about a third. At decode sizes a compiled call
costs more than the few microseconds of eager work it replaces, so callers use these only on steps of
at least `MIN_TOKENS` tokens (see `AttentionMetadata.compiled`).

Each function is compiled once per process and dtype (dynamic shapes) and shared by all layers and
engines; the eager function stays the definition. When TorchInductor cannot compile here (no C++
compiler, say), the first failure is logged once and everything runs eagerly from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

MIN_TOKENS = 64  # smallest step (tokens) that runs the compiled functions

_compiled: dict[Callable, Callable] = {}
_broken: list[str] = []


def available() -> bool:
    """False once a compilation has failed in this process."""
    return not _broken


def call(compiled: bool, fn: Callable, *args):
    """`fn(*args)`; with `compiled`, through its compiled version unless compilation is unavailable here."""
    if compiled and not _broken:
        try:
            if fn not in _compiled:
                _compiled[fn] = torch.compile(fn, dynamic=True)
            return _compiled[fn](*args)
        except Exception as e:  # inductor fails with many exception types (compiler missing, lowering)
            msg = str(e).strip().splitlines()
            _broken.append(f"{type(e).__name__}: {msg[0] if msg else ''}")
            log.warning("compiled kernels unavailable (%s); running eagerly", _broken[0])
    return fn(*args)


def wanted(dtype: torch.dtype, device: torch.device, num_tokens: int) -> bool:
    """Whether a step of `num_tokens` in `dtype` on `device` should use the compiled functions.

    Only low-precision CPU steps: fp32 stays eager so that greedy fp32 output remains token-identical
    to transformers (a fused kernel rounds differently), and CUDA is not measured yet."""
    return (available() and device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
            and num_tokens >= MIN_TOKENS)
