"""Tiny-tensor helpers shared by the quantization tests."""

from __future__ import annotations

import torch


def correlated_inputs(n: int, in_features: int, outliers: int = 4, seed: int = 0) -> torch.Tensor:
    """Activations like a transformer's: low-rank correlated channels plus a few large ones."""
    g = torch.Generator().manual_seed(seed)
    rank = max(1, in_features // 8)
    x = torch.randn(n, rank, generator=g) @ torch.randn(rank, in_features, generator=g) / 3
    x = x + 0.3 * torch.randn(n, in_features, generator=g)
    x[:, :outliers] *= 20
    return x


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def out_err(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """‖W·X − Ŵ·X‖ over a batch of inputs x [n, in]."""
    return float((x @ (w.float() - w_hat.float()).t()).norm())
