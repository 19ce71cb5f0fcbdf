"""The worst-case error of a bf16 matmul that sums in float32 and rounds once, for tests.

Why: which kernel runs a bf16 matmul depends on the CPU (AMX tiles, AVX512-BF16 pairs, oneDNN's choice by
shape), and each sums in its own order, so two correct kernels need not agree bitwise. What every one of
them guarantees is the standard bound (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1):
products of bf16 values are exact in float32; a float32 sum of n terms in any order is off by at most
gamma_n * sum|terms|, gamma_n = n u / (1 - n u), u = 2^-24; the final rounding to bf16 adds at most 2^-8 of
the value. Denormals are assumed absent (the tests draw normal values).
"""

from __future__ import annotations

import torch

FP32_UNIT = 2.0**-24  # float32 unit roundoff (24-bit significand)
BF16_UNIT = 2.0**-8  # bf16 unit roundoff (8-bit significand)


def gamma(n: int, unit: float = FP32_UNIT) -> float:
    if n * unit >= 1:
        raise ValueError(f"no bound for {n} terms at unit roundoff {unit}")
    return n * unit / (1 - n * unit)


def bf16_linear_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                          scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, bound) for y = (x @ w.T) * scale + bias over bf16 (or int8) operands, rounded to bf16: the
    float64 result (exact for these sizes up to float64 rounding, far below the bound) and the largest
    |y_kernel - exact| a float32-summing kernel may produce, elementwise."""
    xd, wd = x.detach().double(), w.detach().double()
    s = torch.ones(w.shape[0], dtype=torch.float64) if scale is None else scale.detach().double()
    b = torch.zeros(w.shape[0], dtype=torch.float64) if bias is None else bias.detach().double()
    exact = (xd @ wd.T) * s + b
    # K products, the scale's multiplication and the bias's addition: K + 2 float32 roundings at most
    e32 = gamma(x.shape[-1] + 2) * ((xd.abs() @ wd.abs().T) * s.abs() + b.abs())
    return exact, e32 + BF16_UNIT * (exact.abs() + e32)


def within_bf16_linear_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                             scale: torch.Tensor | None = None) -> tuple[bool, float]:
    """Whether `got` is within `bf16_linear_reference`'s bound everywhere, and the worst |error| / bound."""
    exact, bound = bf16_linear_reference(x, w, bias, scale)
    ratio = float(((got.detach().double() - exact).abs() / bound.clamp(min=1e-300)).max())
    return ratio <= 1.0, ratio
