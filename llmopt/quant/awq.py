"""AWQ: protect the weights that meet large activations by scaling input channels before RTN
(Lin et al. 2023), then clip weight ranges to minimize the output error.

Scaling is free at inference: W·x = (W·diag(s))·(x/s), and 1/s is folded into the op that produces
x (an RMSNorm weight, or the rows of v_proj / up_proj). The searches here are tensor-level; the
caller decides which linears share an input and where the 1/s goes:

* q, k, v (or fused qkv_proj) ← input_layernorm          → `fold_scales_into_norm`
* gate, up (or fused gate_up_proj) ← post_attention_layernorm → `fold_scales_into_norm`
* o_proj ← v_proj rows (+ bias) (only when num_heads == num_kv_heads; with GQA the scales of the
  heads sharing one kv head would have to be tied, so skip it) → `fold_scales_into_linear_rows`
* down_proj ← up_proj rows                                 → `fold_scales_into_linear_rows`
"""

from __future__ import annotations

import torch

from llmopt.errors import LlmoptError
from llmopt.quant.rtn import rtn_fake_quantize
from llmopt.quant.scheme import QuantScheme


def _sample_tokens(x: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """[..., in] -> [n, in] float32 with at most `max_tokens` evenly strided rows."""
    x = x.reshape(-1, x.shape[-1])
    if x.shape[0] > max_tokens:
        idx = torch.linspace(0, x.shape[0] - 1, max_tokens, device=x.device).round().long()
        x = x[idx]
    return x.float()


def _output_mse(x: torch.Tensor, w_ref: torch.Tensor, quantize, chunk: int) -> float:
    """Σ over output channels of mean-squared output error, `quantize` (rows -> their fake-quantized copy)
    applied to a chunk of output channels at a time: whole, its float32 temporaries were several times the
    weight (an 8B gate|up: 0.47 GB each)."""
    total = 0.0
    for start in range(0, w_ref.shape[0], chunk):
        rows = w_ref[start : start + chunk]
        diff = x @ (rows - quantize(rows)).t()
        total += diff.pow(2).sum().item()
    return total / (x.shape[0] * w_ref.shape[0])


@torch.no_grad()
def awq_search_scales(
    x_sample: torch.Tensor,
    weights: list[torch.Tensor],
    scheme: QuantScheme,
    n_grid: int = 20,
    duo_scaling: bool = True,
    max_tokens: int = 512,
    oc_chunk: int = 4096,
) -> tuple[torch.Tensor, float]:
    """Per-input-channel scales s [in] for linears that share the input `x_sample` [..., in].

    For α in {0, 1/n_grid, ..., (n_grid-1)/n_grid}: s = x_mean^α / w_mean^(1-α) (x_mean^α alone
    with `duo_scaling=False`), clamped at 1e-4 and normalized by sqrt(max·min); the loss is the
    MSE between W·x and Q(W·diag(s))·(x/s) over all the weights. s = 1 (plain RTN) is a candidate
    too, so the result is never worse than RTN on the sample. Returns (s, best_loss).
    Multiply the weights' input columns by s (`scale_linear_inputs`) and fold 1/s into the producer.
    """
    if not weights:
        raise LlmoptError("awq_search_scales needs at least one weight")
    in_features = x_sample.shape[-1]
    for w in weights:
        if w.dim() != 2 or w.shape[1] != in_features:
            raise LlmoptError(f"weight shape {tuple(w.shape)} does not take {in_features} inputs")
    scheme.check_in_features(in_features)
    x = _sample_tokens(x_sample, max_tokens)
    W = torch.cat([w.float().to(x.device) for w in weights], dim=0)

    x_mean = x.abs().mean(0)
    gs = scheme.effective_group_size(in_features)
    w_norm = W.abs().reshape(W.shape[0], -1, gs)
    w_norm /= w_norm.amax(-1, keepdim=True).clamp(min=1e-8)
    w_mean = w_norm.reshape(W.shape).mean(0)
    del w_norm

    def loss_for(s: torch.Tensor) -> float:
        return _output_mse(x, W, lambda rows: rtn_fake_quantize(rows * s[None, :], scheme) / s[None, :], oc_chunk)

    best_s = torch.ones(in_features, device=x.device)
    best = loss_for(best_s)
    for k in range(n_grid):
        alpha = k / n_grid
        if duo_scaling:
            s = x_mean.pow(alpha) / w_mean.pow(1 - alpha).clamp(min=1e-4)
        else:
            s = x_mean.pow(alpha)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        if not torch.isfinite(s).all():
            continue
        loss = loss_for(s)
        if loss < best:
            best, best_s = loss, s
    return best_s, best


@torch.no_grad()
def awq_search_clip(
    x_sample: torch.Tensor,
    w: torch.Tensor,
    scheme: QuantScheme,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    max_tokens: int = 512,
    oc_chunk: int = 256,
) -> torch.Tensor:
    """Clip thresholds max_val [out, n_groups] for RTN of `w` [out, in] (apply after scaling).

    For each (output channel, group) tries max_val = absmax·(1 - i/n_grid), i < max_shrink·n_grid,
    and keeps the one whose partial output Σ_{c∈group} w_c·x_c is closest (MSE over sampled tokens)
    to the unquantized one. Pass the result to `rtn_quantize(w, scheme, max_val=...)`.
    Memory is bounded by n_groups × oc_chunk × max_tokens floats.
    """
    out, in_features = w.shape
    if x_sample.shape[-1] != in_features:
        raise LlmoptError(f"x_sample has {x_sample.shape[-1]} features, weight takes {in_features}")
    gs = scheme.effective_group_size(in_features)
    ng = in_features // gs
    x = _sample_tokens(x_sample, max_tokens).to(w.device)
    xg = x.reshape(-1, ng, gs).permute(1, 2, 0)  # [ng, gs, n]
    W = w.float()
    result = torch.empty(out, ng, device=w.device)
    steps = max(1, int(max_shrink * n_grid))
    for start in range(0, out, oc_chunk):
        wc = W[start : start + oc_chunk]  # [oc, in]
        oc = wc.shape[0]
        wgrp = wc.reshape(oc, ng, gs).transpose(0, 1)  # [ng, oc, gs]
        ref = torch.bmm(wgrp, xg)  # [ng, oc, n]
        absmax = wc.abs().reshape(oc, ng, gs).amax(-1)  # [oc, ng]
        best_err = torch.full((oc, ng), float("inf"), device=w.device)
        best_max = absmax.clone()
        for i in range(steps):
            max_val = absmax * (1 - i / n_grid)
            wq = rtn_fake_quantize(wc, scheme, max_val=max_val)
            cur = torch.bmm(wq.reshape(oc, ng, gs).transpose(0, 1), xg)
            err = (cur - ref).pow(2).mean(-1).transpose(0, 1)  # [oc, ng]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better, max_val, best_max)
        result[start : start + oc] = best_max
    return result


def scale_linear_inputs(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W·diag(s): multiply input column c of `weight` [out, in] by s[c] (returns a new tensor)."""
    return (weight.float() * scales.float()[None, :]).to(weight.dtype)


def fold_scales_into_norm(norm_weight: torch.Tensor, scales: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm weight / s, so the norm emits x/s for the scaled linears that follow it. `offset`: the
    norm scales by (weight + offset) (Gemma's 1 + w), so the stored weight becomes (w + offset) / s - offset."""
    return ((norm_weight.float() + offset) / scales.float() - offset).to(norm_weight.dtype)


def fold_scales_into_linear_rows(prev_weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Divide output row r of the producing linear by s[r], so it emits x/s.

    A producer with a bias (qwen2's v_proj) needs `fold_scales_into_bias` on it as well.
    """
    if prev_weight.shape[0] != scales.shape[0]:
        raise LlmoptError(
            f"cannot fold {scales.shape[0]} scales into a linear with {prev_weight.shape[0]} outputs"
        )
    return (prev_weight.float() / scales.float()[:, None]).to(prev_weight.dtype)


def fold_scales_into_bias(prev_bias: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bias / s, for a producing linear whose rows were folded with `fold_scales_into_linear_rows`."""
    if prev_bias.shape != scales.shape:
        raise LlmoptError(
            f"cannot fold {scales.shape[0]} scales into a bias of shape {tuple(prev_bias.shape)}"
        )
    return (prev_bias.float() / scales.float()).to(prev_bias.dtype)
