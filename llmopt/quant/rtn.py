"""Round-to-nearest (RTN) quantization, plus the scale/zero helpers GPTQ and AWQ reuse.

RTN is the baseline every smarter algorithm is measured against, and its parameter math (how a
[min, max] range becomes a scale and an integer zero) is shared so that all of them agree.
"""

from __future__ import annotations

import torch

from llmopt.errors import LlmoptError
from llmopt.quant import range_search_kernel
from llmopt.quant.qtensor import QuantizedWeight, identity_g_idx, row_blocks
from llmopt.quant.scheme import QuantScheme


def _round_scale(scale: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Round scales *up* in magnitude to the storage dtype now, so codes are chosen against the stored scale
    and the extreme that set it stays on its code (the range is not cut short); the sign is kept."""
    dt = scheme.torch_scale_dtype
    sign = torch.where(scale < 0, -1.0, 1.0)
    scale = scale.float().abs().clamp(min=torch.finfo(dt).tiny)
    if dt != torch.float32:
        r = scale.to(dt)
        up = torch.nextafter(r, torch.full_like(r, float("inf")))
        scale = torch.where(r.float() < scale, up, r).float()
    return scale * sign


# Symmetric schemes whose scale may be negative: int4, where one step of 16 matters (benchmarks/int4_scale_sign.py)
SIGNED_SCALE_BITS = (4,)


def params_from_range(
    xmin: torch.Tensor, xmax: torch.Tensor, scheme: QuantScheme
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and integer zero (both float32, any shape) for values in [xmin, xmax].

    Symmetric (zero = 2^(bits-1), signed codes [-2^(bits-1), 2^(bits-1) - 1], e.g. [-128, 127]):
    scale = max(-min / 2^(bits-1), max / (2^(bits-1) - 1)), the smallest step whose code range holds
    [min, max] whole — a negative extreme lands exactly on the lowest code, a positive one on the highest,
    nothing is clipped. int4 (`SIGNED_SCALE_BITS`), where one step of 16 matters, takes llama.cpp Q4_0's
    d = extreme / -8 instead, signed: the group's largest-magnitude weight lands on -8 whatever its sign (8
    steps up to a positive one instead of 7), and a weight on the other side past 7·|d| is clipped to it
    (measured better than the smaller step of either sign that clips nothing: benchmarks/int4_scale_sign.py,
    docs/QUANTIZE.md "The sign of the scale"). Readers compute (q - zero)·scale, so neither choice changes a
    format. (compressed-tensors / llm-compressor use absmax / 7.5 instead, which always clips a group's
    largest-magnitude weight by half a step: a positive one to 7·s = 0.933·absmax, a negative one
    onto the -7.5 rounding tie, i.e. -8 or -7 depending on how the scale rounds; the systematic
    shrinking of the salient weights costs perplexity, see docs/QUANTIZE.md "Against llm-compressor".)
    Asymmetric: the range is widened to include 0, scale = (max - min) / maxq and
    zero = round(-min / scale), kept in [1, maxq] (see qtensor: GPTQ v1 stores zero - 1).
    An all-zero range gets scale 1 so that it dequantizes to exact zeros.
    """
    maxq = scheme.maxq
    xmin = torch.minimum(xmin.float(), torch.zeros_like(xmin, dtype=torch.float32))
    xmax = torch.maximum(xmax.float(), torch.zeros_like(xmax, dtype=torch.float32))
    if scheme.symmetric:
        half = scheme.sym_zero
        if scheme.bits in SIGNED_SCALE_BITS:  # the signed extreme on the lowest code (Q4_0)
            extreme_negative = -xmin >= xmax
            scale = torch.where(extreme_negative, -xmin, -xmax) / half
        else:
            scale = torch.maximum(-xmin / half, xmax / (half - 1))
        scale = torch.where(scale != 0, scale, torch.ones_like(scale))
        scale = _round_scale(scale, scheme)
        return scale, torch.full_like(scale, scheme.sym_zero)
    span = xmax - xmin
    scale = torch.where(span > 0, span / maxq, torch.ones_like(span))
    scale = _round_scale(scale, scheme)
    zero = torch.round(-xmin / scale)
    # A range that starts at 0 would need zero 0; shift it to 1 and widen the step to keep xmax.
    # (computed unconditionally: no host sync on accelerators)
    low = zero < 1
    widened = _round_scale(torch.where(xmax > 0, xmax / (maxq - 1), 1.0), scheme)
    scale = torch.where(low, widened, scale)
    return scale, zero.clamp(1, maxq)


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Integer codes (float tensor) clamp(round(w / scale) + zero, 0, maxq); broadcasts."""
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Quantize then dequantize: scale · (q - zero)."""
    return scale * (quantize_codes(w, scale, zero, maxq) - zero)


def _group_view(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """[out, in] -> [out, n_groups, group_size] (contiguous groups)."""
    out, inp = w.shape
    gs = scheme.effective_group_size(inp)
    return w.reshape(out, inp // gs, gs)


MSE_ELEMENTS = 1 << 24  # candidates x rows x cols that mse_params evaluates at once: 64 MB a float32 temporary


def mse_params(
    w: torch.Tensor,
    scheme: QuantScheme,
    maxshrink: float = 0.8,
    grid: int = 100,
    norm: float = 2.4,
    chunk: int = 10,
    weights: torch.Tensor | None = None,
    coarse: int = 8,
    native: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (scale, zero) for `w` [rows, cols] that minimize Σ|w - Q(w)|^norm, or with `weights` (broadcast to
    w; GPTQ passes `gptq.range_weights`, llama.cpp's importance weighting) Σ weights·(w - Q(w))².

    Shrinks the [min, max] range by factors 1 - k/grid for k < maxshrink·grid (the GPTQ reference quantizer's
    grid), coarse to fine: every `coarse`-th k, then each row's neighbours of its best; the unshrunk range is a
    candidate, so the result is never worse than min/max. Candidates are evaluated `chunk` at a time over slabs of
    rows, so a temporary holds at most `MSE_ELEMENTS` values (GPTQ's static groups pass a whole weight: unbounded, a
    gptq_quantize call peaked at 1.10 GB of live tensors on a 1.2B gate_proj and 5.60 GB on Llama-3-8B's).

    With `weights`, on a CPU, the errors come from `range_search.c` when it builds (`native`; False: torch), whose
    only temporaries are the [chunk, rows] scores: the same arithmetic, summed in another order.
    """
    rows = w.shape[0]
    kernel = range_search_kernel.load() if native and weights is not None and w.device.type == "cpu" else None
    slab = max(1, MSE_ELEMENTS // (chunk * max(w.shape[-1], 1)))
    if kernel is None and rows > slab:  # rows are independent: a slab at a time bounds the temporaries, same result
        per_row = weights is not None and weights.dim() == 2 and weights.shape[0] == rows
        parts = [mse_params(w[r:r + slab], scheme, maxshrink, grid, norm, chunk,
                            weights[r:r + slab] if per_row else weights, coarse, native)  # type: ignore[index]
                 for r in range(0, rows, slab)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    w = w.float()
    xmin, xmax = w.amin(dim=1), w.amax(dim=1)
    if weights is not None:
        norm = 2.0
    wt = torch.ones((), device=w.device) if weights is None else weights.float().to(w.device)
    if kernel is not None:  # the kernel reads both in row order: made so once here, not per chunk of candidates
        w, wt = w.contiguous(), wt.contiguous()
    steps = max(int(maxshrink * grid), 1)
    best_err = torch.full((rows,), float("inf"), device=w.device)
    best_k = torch.zeros(rows, dtype=torch.long, device=w.device)
    best_scale = torch.empty(rows, device=w.device)
    best_zero = torch.empty(rows, device=w.device)

    def consider(ks: torch.Tensor) -> None:  # [candidates, rows] shrink steps
        nonlocal best_err, best_k, best_scale, best_zero
        pick = torch.arange(rows, device=w.device)
        for start in range(0, ks.shape[0], chunk):
            k = ks[start:start + chunk]
            p = 1 - k.float() / grid
            scale, zero = params_from_range(p * xmin, p * xmax, scheme)  # [c, rows]
            if kernel is not None:
                err = kernel.errors(w, wt, scale, zero, scheme.maxq)
            else:
                err = ((fake_quantize(w, scale[..., None], zero[..., None], scheme.maxq) - w).abs().pow(norm)
                       * wt).sum(-1)
            err_min, arg = err.min(dim=0)
            better = err_min < best_err
            best_err = torch.where(better, err_min, best_err)
            best_k = torch.where(better, k[arg, pick], best_k)
            best_scale = torch.where(better, scale[arg, pick], best_scale)
            best_zero = torch.where(better, zero[arg, pick], best_zero)

    consider(torch.arange(0, steps, coarse, device=w.device)[:, None].expand(-1, rows))
    if coarse > 1:
        offsets = torch.tensor([o for o in range(1 - coarse, coarse) if o], device=w.device)
        consider((best_k[None] + offsets[:, None]).clamp(0, steps - 1))
    return best_scale, best_zero


def group_params(
    w: torch.Tensor,
    scheme: QuantScheme,
    clip_ratio: float = 1.0,
    max_val: torch.Tensor | None = None,
    mse: bool = False,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero [out, n_groups] for contiguous groups of `w` [out, in].

    `clip_ratio` shrinks each group's range; `max_val` [out, n_groups] (from AWQ clip search)
    clamps weights to ±max_val first; `mse` runs the shrink-grid search instead of min/max, weighing each
    weight's squared error by `weights` (broadcast to [out, in]) when given (GPTQ: `gptq.range_weights`).
    """
    if not mse:  # each group's min and max, a block of rows at a time: a bf16 weight's float32 copy and the
        # clamp's two were whole-weight temporaries (an 8B head: 2.1 GB each); the same values, exactly
        lo, hi = [], []
        for rows in row_blocks(*w.shape):
            g = _clamped(_group_view(w[rows].float(), scheme), None if max_val is None else max_val[rows])
            lo.append(g.amin(-1))
            hi.append(g.amax(-1))
        return params_from_range(torch.cat(lo) * clip_ratio, torch.cat(hi) * clip_ratio, scheme)
    g = _clamped(_group_view(w.float(), scheme), max_val)
    out, ng, gs = g.shape
    wts = None if weights is None else weights.float().to(g.device).expand(out, ng * gs).reshape(out * ng, gs)
    scale, zero = mse_params(g.reshape(out * ng, gs), scheme, weights=wts)
    return scale.reshape(out, ng), zero.reshape(out, ng)


def _clamped(g: torch.Tensor, max_val: torch.Tensor | None) -> torch.Tensor:
    """Groups `g` [out, n_groups, group_size] clamped to ±max_val [out, n_groups] (AWQ's clip), if given."""
    if max_val is None:
        return g
    mv = max_val.float().to(g.device)[..., None]
    return torch.maximum(torch.minimum(g, mv), -mv)


def quantize_with_params(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx: torch.Tensor, scheme: QuantScheme
) -> QuantizedWeight:
    """Build a QuantizedWeight from `w` [out, in] and already-chosen per-group parameters."""
    idx = g_idx.long()
    q = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    for rows in row_blocks(*w.shape):  # small temporaries (qtensor.row_blocks); the same codes
        q[rows] = quantize_codes(w[rows].float(), scale[rows][:, idx], zero[rows][:, idx], scheme.maxq)
    zero_t = None if scheme.symmetric else zero.to(torch.uint8)
    return QuantizedWeight(q=q, scale=scale.float(), zero=zero_t, g_idx=g_idx.to(torch.int32), scheme=scheme)


def rtn_quantize(
    w: torch.Tensor,
    scheme: QuantScheme,
    clip_ratio: float = 1.0,
    max_val: torch.Tensor | None = None,
    mse: bool = False,
) -> QuantizedWeight:
    """Round-to-nearest quantization of `w` [out, in] to an int scheme, per group or per channel."""
    if scheme.kind != "int":
        raise LlmoptError(f"rtn_quantize handles int schemes; use fp8_quantize for {scheme.describe()}")
    if w.dim() != 2:
        raise LlmoptError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    if not 0 < clip_ratio <= 1:
        raise LlmoptError(f"clip_ratio must be in (0, 1], got {clip_ratio}")
    scheme.check_in_features(w.shape[1])
    scale, zero = group_params(w, scheme, clip_ratio=clip_ratio, max_val=max_val, mse=mse)
    g_idx = identity_g_idx(w.shape[1], scheme.group_size, w.device)
    return quantize_with_params(w, scale, zero, g_idx, scheme)


def rtn_fake_quantize(
    w: torch.Tensor, scheme: QuantScheme, max_val: torch.Tensor | None = None
) -> torch.Tensor:
    """Q(w) in float32 with contiguous groups (used inside AWQ's searches; no QuantizedWeight)."""
    scale, zero = group_params(w, scheme, max_val=max_val)
    g = _clamped(_group_view(w.float(), scheme), max_val)
    return fake_quantize(g, scale[..., None], zero[..., None], scheme.maxq).reshape(w.shape)
