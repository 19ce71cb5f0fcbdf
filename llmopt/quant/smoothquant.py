"""SmoothQuant (Xiao et al. 2023): move activation outliers into the weights before W8A8.

Per input channel j, s_j = max|X_j|^α / max|W_j|^(1−α) (W: every weight that reads X, stacked);
then X/s has no outlier channel left to ruin per-token int8, and W·diag(s) absorbs it (weights
quantize per output channel, so a scaled column costs little). 1/s is folded into the producer of X
with the same helpers AWQ uses: input_layernorm (q|k|v), post_attention_layernorm (gate|up) and the
up_proj rows (down_proj). o_proj is not smoothed: under GQA its input heads share v rows.
"""

from __future__ import annotations

import torch

from llmopt.errors import LlmoptError


def smoothing_scales(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float = 0.5,
                     eps: float = 1e-5) -> torch.Tensor:
    """s [in] for activations with per-channel absmax `act_absmax` [in] feeding `weight` [out, in]."""
    if weight.shape[1] != act_absmax.shape[0]:
        raise LlmoptError(f"activation stats have {act_absmax.shape[0]} channels, weight takes {weight.shape[1]}")
    if not 0 <= alpha <= 1:
        raise LlmoptError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    a = act_absmax.float().clamp(min=eps)
    w = weight.float().abs().amax(dim=0).clamp(min=eps)
    s = a.pow(alpha) / w.pow(1 - alpha)
    # dead channels (never active) keep s = 1 rather than shrinking their weights to nothing
    return torch.where(act_absmax.float() > eps, s, torch.ones_like(s)).clamp(min=eps)
