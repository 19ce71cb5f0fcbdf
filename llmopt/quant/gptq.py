"""GPTQ: quantize a linear's weight column by column, compensating each rounding error on the
columns not yet quantized through the inverse Hessian of the layer's inputs (Frantar et al. 2022).

The caller feeds the layer's real inputs to `GPTQ.add_batch` (H = 2/n · Σ x xᵀ), then calls
`gptq_quantize(W, H, scheme)`, or factors H once (`gptq_factor`) for several calls on it. Everything is plain
float32 torch on W's device (CPU or CUDA).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from llmopt.errors import LlmoptError
from llmopt.quant.qtensor import QuantizedWeight, identity_g_idx
from llmopt.quant.rtn import group_params, mse_params, params_from_range, quantize_codes
from llmopt.quant.scheme import QuantScheme

PRODUCT_BLOCK = 1 << 24  # elements of one block of a low-precision xᵀx product (64 MB in float32)


class GPTQ:
    """Running Hessian H = 2/n · Σ x xᵀ of one linear's inputs (n = tokens seen so far)."""

    def __init__(self, in_features: int, device: torch.device | str | None = None,
                 product_dtype: torch.dtype = torch.float32) -> None:
        """`product_dtype` is the dtype of each batch's xᵀx product (accumulated into float32 H):
        bfloat16 is ~5x faster on CPUs with bf16 units, at ~0.4% relative rounding per batch — below
        the 1% dampening and the noise of bf16 calibration activations it is meant for."""
        self.in_features = in_features
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.nsamples = 0
        self.product_dtype = product_dtype

    @torch.no_grad()
    def add_batch(self, x: torch.Tensor) -> None:
        """Accumulate inputs `x` [..., in] (any float dtype); every leading position is one sample."""
        if x.shape[-1] != self.in_features:
            raise LlmoptError(f"GPTQ input has {x.shape[-1]} features, expected {self.in_features}")
        x = x.reshape(-1, self.in_features).to(device=self.H.device, dtype=torch.float32)
        n = x.shape[0]
        if n == 0:
            return
        total = self.nsamples + n
        self.H.mul_(self.nsamples / total)
        x = x * math.sqrt(2.0 / total)
        if self.product_dtype == torch.float32:
            self.H.addmm_(x.t(), x)
        else:
            xp = x.to(self.product_dtype)
            # by blocks of rows (whole up to 4,096 inputs): the whole product and its float32 copy were 1.2 GB
            # beside H at an 8B down_proj; rows in multiples of 256, where blocks gave H bitwise equal to the whole
            # product's (measured on the Intel Xeon VM at 5,632 and 14,336 inputs; elsewhere, within bf16 rounding)
            rows = max(256, (PRODUCT_BLOCK // self.in_features) // 256 * 256)
            for lo in range(0, self.in_features, rows):
                self.H[lo:lo + rows].add_((xp[:, lo:lo + rows].t() @ xp).float())
        self.nsamples = total

    def quantize(self, w: torch.Tensor, scheme: QuantScheme, **kwargs) -> tuple[QuantizedWeight, float]:
        """`gptq_quantize(w, self.H, scheme, **kwargs)`."""
        if self.nsamples == 0:
            raise LlmoptError("GPTQ has seen no calibration inputs; call add_batch first")
        return gptq_quantize(w, self.H, scheme, **kwargs)

    def take(self) -> torch.Tensor:
        """Hand the Hessian over (for `gptq_quantize(w, [g.take()], ...)`): this object keeps no reference, so
        the callee can free it once factored. An 8B down_proj's Hessian is 14,336² floats, 0.8 GB."""
        if self.nsamples == 0 or self.H is None:
            raise LlmoptError("GPTQ has seen no calibration inputs; call add_batch first")
        H, self.H = self.H, None
        return H


@contextlib.contextmanager
def _single_thread_on_cpu(device: torch.device) -> Iterator[None]:
    """Run the per-column loop on one CPU thread: its ops are tiny, so intra-op threads only add
    sync overhead, and on a busy machine they stall it badly (measured 30 ms vs 5 s for a
    1536x576 layer with 2 threads on 2 shared cores). The big block updates stay multi-threaded."""
    if device.type != "cpu":
        yield
        return
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _damped_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Lower Cholesky factor of H + λI with λ = damp · mean(diag H), H damped in place (retries with more
    damping). In place, and without an identity matrix: each n x n float32 copy is 0.8 GB at n = 14,336."""
    diag = H.diagonal()
    orig = diag.clone()
    mean_diag = torch.mean(orig).item()
    cur = damp
    for _ in range(4):
        diag.copy_(orig + cur * mean_diag)
        L, info = torch.linalg.cholesky_ex(H)
        if int(info) == 0:
            return L
        del L
        cur *= 10
    raise LlmoptError(
        f"GPTQ: the Hessian is not positive definite even with damp={cur / 10:g}; "
        "use more or more varied calibration data"
    )


INVERSE_LEAF = 512  # blocks up to this size are inverted by one solve against the identity


def _upper_triangular_inverse(U: torch.Tensor) -> torch.Tensor:
    """U⁻¹ for an upper triangular U, in place (U is overwritten and returned), by halves: inv([[A, B], [0, C]]) =
    [[A⁻¹, -A⁻¹·B·C⁻¹], [0, C⁻¹]], the corner by two triangular solves against A and C before they are inverted.
    n³/3 multiply-adds where one solve against the identity does n³ (at n = 8,192, 2 threads: 0.9 s against
    2.5 s); in place, so the inverse needs U and two quarter-size temporaries, not a second n x n matrix (0.8 GB
    at an 8B down_proj's n = 14,336)."""
    if U.shape[0] <= INVERSE_LEAF:
        return _solved(U)
    _invert_in_place(U, 0, U.shape[0])
    return U


def _solved(U: torch.Tensor) -> torch.Tensor:
    return torch.linalg.solve_triangular(U, torch.eye(U.shape[0], device=U.device, dtype=U.dtype), upper=True)


def _invert_in_place(U: torch.Tensor, lo: int, hi: int) -> None:
    """U[lo:hi, lo:hi] = U[lo:hi, lo:hi]⁻¹: the corner first, from A and C as they are, then A and C. (A module
    function: a nested recursive one is a reference cycle that kept its frame's tensors alive until the garbage
    collector ran: +0.46 GB per 1.2B layer, session 37.)"""
    if hi - lo <= INVERSE_LEAF:
        U[lo:hi, lo:hi] = _solved(U[lo:hi, lo:hi])
        return
    mid = (lo + hi) // 2
    corner = torch.linalg.solve_triangular(U[lo:mid, lo:mid], U[lo:mid, mid:hi], upper=True)
    U[lo:mid, mid:hi] = torch.linalg.solve_triangular(U[mid:hi, mid:hi], corner, upper=True, left=False).neg_()
    del corner
    _invert_in_place(U, lo, mid)
    _invert_in_place(U, mid, hi)


def _upper_inverse_factor(L: list[torch.Tensor]) -> torch.Tensor:
    """Upper Cholesky factor of H⁻¹, given the lower Cholesky factor of H reversed (P·H·P = L·Lᵀ, P the reversal
    permutation), taken out of the one-item list so it is freed as soon as its reversal exists.

    Why reversed: Ũ = P·L·P is upper triangular with H = Ũ·Ũᵀ, so H⁻¹ = Ũ⁻ᵀ·Ũ⁻¹ and Ũ⁻¹ (upper, positive
    diagonal) is H⁻¹'s upper Cholesky factor: one Cholesky and one triangular inverse, ~2/3 n³ multiply-adds. The
    textbook route (H⁻¹ = L⁻ᵀL⁻¹ by a solve against the identity and a product, then a second Cholesky) does ~3.3
    n³: at n = 8,192 (a down_proj of a 1B model) 8.5 s of a 10.6 s GPTQ call, 2 threads. (torch's cholesky_inverse,
    LAPACK's potri, is not used: pathologically slow multi-threaded on a busy CPU, 1 s vs 40 ms.)"""
    upper = L.pop().flip(0, 1)
    return _upper_triangular_inverse(upper)


def range_weights(w: torch.Tensor, hdiag: torch.Tensor, sigma2: torch.Tensor) -> torch.Tensor:
    """Each weight's importance in GPTQ's range search, llama.cpp's form (its k-quants with an importance
    matrix): the input's E[x²] times sqrt(σ² + w²), σ² = 2·mean(w²), here over the whole row. The sqrt term
    keeps a large weight costly where its input is quiet; the Hessian diagonal alone over-fits Gemma 3's
    peaked inputs (held-out KL 0.260 against 0.231 with this form; docs/QUANTIZE.md, "GPTQ ranges").
    `w` [out, n], `hdiag` [n], `sigma2` [out]."""
    return hdiag * torch.sqrt(sigma2[:, None] + w * w)


@dataclass
class GPTQFactor:
    """What every GPTQ call on one Hessian shares, whatever the grid: H⁻¹'s upper Cholesky factor in processing
    order, the act-order permutation, and H's diagonal. `--scheme auto` measures up to four grids per linear on
    one Hessian; factoring it once is 9.4 s saved per grid at an 8B down_proj's 14,336 inputs (docs/QUANTIZE.md,
    "GPTQ's cost per call"). Read only by the calls, so one factor serves any number of them."""

    hinv: torch.Tensor  # [n, n] upper factor of H⁻¹, rows and columns in processing order
    perm: torch.Tensor | None  # processing order (act-order: decreasing H_ii), None for the natural one
    hdiag: torch.Tensor  # [n] diag H, dead inputs set to 1, original order
    dead: torch.Tensor  # [n] bool: inputs no calibration token reached (H_ii == 0)
    damp: float
    act_order: bool


@torch.no_grad()
def gptq_factor(H: torch.Tensor | list[torch.Tensor], damp: float = 0.01, act_order: bool = True,
                device: torch.device | str | None = None) -> GPTQFactor:
    """Factor the input Hessian `H` [n, n] for `gptq_quantize`. Handed over as a one-item list (`[g.take()]`,
    which this empties), H is damped and factored in place and freed once factored: the peak is two n x n
    matrices past `INVERSE_LEAF` inputs (three up to it), where it was 4.5 before session 39 and seven before
    session 37 (0.8 GB each at an 8B down_proj). A list, because a tensor passed directly stays referenced by
    the caller's frame until the call returns: that kept one more n x n matrix alive through every call
    (session 39). A tensor passed directly is copied, and left as it was.

    * dead inputs (H_ii == 0) get H_ii = 1 (and `gptq_quantize` a zeroed weight column);
    * λ = damp · mean(diag H) is added to the diagonal before the Cholesky of H⁻¹;
    * `act_order` processes columns by decreasing H_ii."""
    own_h = isinstance(H, list)
    if own_h:
        H = H.pop()
    if H.dim() != 2 or H.shape[0] != H.shape[1]:
        raise LlmoptError(f"expected a square Hessian, got shape {tuple(H.shape)}")
    H = H.detach().to(device=device if device is not None else H.device, dtype=torch.float32)
    if not own_h:
        H = H.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    hdiag = torch.diag(H).clone()  # each input's E[x_i²] up to a constant
    perm = torch.argsort(hdiag, descending=True) if act_order else None
    # H in processing order and reversed (see _upper_inverse_factor); with act-order by row gathers (H is
    # symmetric: the transpose of H[r] is H with its columns in r's order); one statement per copy, so that
    # each frees the one before it: two n x n matrices at a time, not three
    if perm is None:
        H = H.flip(0, 1)
    else:
        back = perm.flip(0)
        H = H[back]
        H = H.t().contiguous()
        H = H[back]
    L = [_damped_cholesky(H, damp)]
    del H
    return GPTQFactor(_upper_inverse_factor(L), perm, hdiag, dead, damp, act_order)


@torch.no_grad()
def gptq_quantize(
    w: torch.Tensor,
    H: torch.Tensor | list[torch.Tensor] | GPTQFactor,
    scheme: QuantScheme,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = True,
    static_groups: bool = True,
    mse_observer: bool = False,
) -> tuple[QuantizedWeight, float]:
    """Quantize `w` [out, in] with GPTQ given the input Hessian `H` [in, in], or its `gptq_factor` (made with the
    same `damp` and `act_order`; shared by calls on one Hessian). A Hessian is factored here, as `gptq_factor`
    says (a one-item list is emptied, and H freed once factored).

    * dead inputs (H_ii == 0) get a zeroed weight column;
    * columns are processed in blocks of `block_size` with lazy updates of the rest;
    * with `static_groups` (the default) group parameters are fixed up front from the original
      contiguous groups, as RTN picks them (so act-order keeps identity g_idx); without, they are chosen
      when a group's first column is reached, from the already error-compensated weights;
    * `act_order` (the default) processes columns by decreasing H_ii; without static groups, g_idx
      records each column's group in the original column order. The defaults are llm-compressor's
      (actorder "static"): plain GPTQ (act_order=False, static_groups=False) came out worse than RTN on
      SmolLM2 (docs/QUANTIZE.md, "GPTQ defaults");
    * `mse_observer` picks each group's range by a shrink-grid search of the squared error weighted as
      llama.cpp weighs its scale search (`range_weights`: the Hessian diagonal, llama.cpp's importance matrix,
      times sqrt(σ² + w²)), instead of min/max. Measured (docs/QUANTIZE.md, "GPTQ ranges"): held-out KL of
      W4A16 g32 + int8 head 0.139 -> 0.090 on SmolLM2, 0.243 -> 0.231 on Gemma 3 (WikiText-2).

    Returns the QuantizedWeight and the GPTQ loss Σ (w - q)² / (2 [H⁻¹]_ii²) (a proxy for the
    increase in output error, useful to compare layers).
    """
    if scheme.kind != "int":
        raise LlmoptError(f"GPTQ quantizes int schemes; got {scheme.describe()}")
    if w.dim() != 2:
        raise LlmoptError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    out, cols = w.shape
    shape = tuple((H.hinv if isinstance(H, GPTQFactor) else H[0] if isinstance(H, list) else H).shape)
    if shape != (cols, cols):
        raise LlmoptError(f"Hessian shape {shape} does not match in_features {cols}")
    if isinstance(H, GPTQFactor) and (H.damp, H.act_order) != (damp, act_order):
        raise LlmoptError(f"the GPTQ factor was made with damp={H.damp:g}, act_order={H.act_order}; "
                          f"this call asks for damp={damp:g}, act_order={act_order}")
    scheme.check_in_features(cols)
    gs = scheme.effective_group_size(cols)
    n_groups = cols // gs
    grouped = scheme.group_size != -1
    device = w.device

    W = w.detach().to(torch.float32).clone()
    factor = H if isinstance(H, GPTQFactor) else gptq_factor(H, damp, act_order, device)
    del H
    W[:, factor.dead] = 0
    hdiag, perm, Hinv = factor.hdiag, factor.perm, factor.hinv
    sigma2 = 2 * W.pow(2).mean(1)  # each row's, from the weights before any error feedback

    def choose(block: torch.Tensor, cols_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if mse_observer:
            return mse_params(block, scheme, weights=range_weights(block, cols_h, sigma2))
        return params_from_range(block.amin(1), block.amax(1), scheme)

    scale = torch.empty(out, n_groups, device=device)
    zero = torch.empty(out, n_groups, device=device)
    if static_groups or not grouped:
        # Per-channel, or groups fixed before any error feedback (original contiguous columns).
        s0, z0 = group_params(W, scheme, mse=mse_observer,
                              weights=range_weights(W, hdiag, sigma2) if mse_observer else None)
        scale.copy_(s0)
        zero.copy_(z0)

    # Work on Wᵀ [cols, out] so each column (and the in-block update of the remaining columns)
    # is contiguous memory: ~100x faster per-column updates on CPU than strided [:, i:] slices.
    WT = W.t().contiguous()
    del W
    if perm is not None:
        WT = WT[perm]  # rows gathered: a column gather of W was 10x slower
        hdiag = hdiag[perm]

    # group of each *processed* column position
    if act_order and not static_groups:
        col_group = torch.arange(cols, device=device) // gs
    elif act_order:
        col_group = perm // gs
    else:
        col_group = torch.arange(cols, device=device) // gs
    col_group_list = col_group.tolist()

    QT = torch.empty(cols, out, device=device)  # integer codes, processed order
    losses = torch.zeros(out, device=device)
    dynamic_groups = grouped and not static_groups
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        count = i2 - i1
        W1 = WT[i1:i2].clone()
        Err1 = torch.empty(count, out, device=device)
        Hinv1 = Hinv[i1:i2, i1:i2]
        with _single_thread_on_cpu(device):
            for i in range(count):
                col = i1 + i
                if dynamic_groups and col % gs == 0:
                    # the group's columns, with every update applied so far (in-block ones live in W1)
                    end = col + gs
                    if end <= i2:
                        block = W1[i : i + gs]
                    else:  # group straddles blocks: apply this block's pending updates to the rest
                        rest = WT[i2:end] - Hinv[i1:col, i2:end].t() @ Err1[:i]
                        block = torch.cat([W1[i:], rest], dim=0)
                    s, z = choose(block.t(), hdiag[col:col + gs])
                    g = col // gs
                    scale[:, g] = s
                    zero[:, g] = z
                g = col_group_list[col]
                s_col = scale[:, g]
                z_col = zero[:, g]
                wcol = W1[i]
                d = Hinv1[i, i]
                qcol = quantize_codes(wcol, s_col, z_col, scheme.maxq)
                QT[col] = qcol
                err = (wcol - s_col * (qcol - z_col)) / d
                losses += err.pow(2)
                W1[i:].addr_(Hinv1[i, i:], err, alpha=-1)
                Err1[i] = err
        if i2 < cols:
            WT[i2:].addmm_(Hinv[i1:i2, i2:].t(), Err1, alpha=-1)
    if perm is not None:
        inv = torch.argsort(perm)
        QT = QT[inv]
        g_idx = col_group[inv].to(torch.int32)
    else:
        g_idx = identity_g_idx(cols, scheme.group_size, device)
    qw = QuantizedWeight(
        q=QT.to(torch.uint8).t().contiguous(),
        scale=scale,
        zero=None if scheme.symmetric else zero.to(torch.uint8),
        g_idx=g_idx,
        scheme=scheme,
    )
    return qw, float(losses.sum().item()) / 2
