"""Observers: streaming statistics of activations, for `calibrate` and activation-aware methods.

Each observer takes `update(x)` calls with tensors of any shape and answers `compute()` with a
(min, max) pair (scalars, or [C] tensors for per-channel observers, channel = last dim).
Memory is constant in the number of updates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from llmopt.errors import LlmoptError
from llmopt.quant.rtn import fake_quantize, params_from_range
from llmopt.quant.scheme import QuantScheme


class Observer(ABC):
    """Common interface: `update(x)`, `compute() -> (min, max)`, `absmax()`."""

    @abstractmethod
    def update(self, x: torch.Tensor) -> None:
        """Fold one batch of values into the statistics."""

    @abstractmethod
    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The observed range as (min, max)."""

    def absmax(self) -> torch.Tensor:
        lo, hi = self.compute()
        return torch.maximum(lo.abs(), hi.abs())

    def _require(self, seen: bool) -> None:
        if not seen:
            raise LlmoptError(f"{type(self).__name__}.compute() called before any update()")


def _batch_minmax(x: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().float()
    if per_channel:
        x = x.reshape(-1, x.shape[-1])
        return x.amin(0), x.amax(0)
    return x.amin(), x.amax()


class _RunningRange(Observer):
    """A (min, max) kept from batch to batch; subclasses say how a batch's range joins the running one."""

    def __init__(self, per_channel: bool = False) -> None:
        self.per_channel = per_channel
        self.min: torch.Tensor | None = None
        self.max: torch.Tensor | None = None

    @abstractmethod
    def _join(self, old: torch.Tensor, new: torch.Tensor, upper: bool) -> torch.Tensor:
        """The running bound after a batch whose bound is `new` (the max when `upper`, else the min)."""

    def update(self, x: torch.Tensor) -> None:
        lo, hi = _batch_minmax(x, self.per_channel)
        if self.min is None or self.max is None:
            self.min, self.max = lo, hi
        else:
            self.min, self.max = self._join(self.min, lo, False), self._join(self.max, hi, True)

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._require(self.min is not None)
        assert self.min is not None and self.max is not None
        return self.min, self.max


class MinMaxObserver(_RunningRange):
    """Exact running min and max (per tensor, or per last-dim channel)."""

    def _join(self, old: torch.Tensor, new: torch.Tensor, upper: bool) -> torch.Tensor:
        return torch.maximum(old, new) if upper else torch.minimum(old, new)


class EmaObserver(_RunningRange):
    """Moving average of per-batch min/max: m ← m + c·(batch − m), first batch taken as is.

    Same definition as torch.ao's MovingAverageMinMaxObserver (c = averaging_constant = 0.01);
    it forgets rare outlier batches that a min/max observer would keep forever.
    """

    def __init__(self, averaging_constant: float = 0.01, per_channel: bool = False) -> None:
        if not 0 < averaging_constant <= 1:
            raise LlmoptError(f"averaging_constant must be in (0, 1], got {averaging_constant}")
        super().__init__(per_channel)
        self.c = averaging_constant

    def _join(self, old: torch.Tensor, new: torch.Tensor, upper: bool) -> torch.Tensor:
        return old + self.c * (new - old)


class _GrowingHistogram:
    """Fixed-bin histogram over [lo_edge, hi_edge] that doubles its range when data falls outside.

    `signed=False` bins |x| over [0, R]; `signed=True` bins x over [-R, R]. Doubling R merges
    adjacent bin pairs exactly (each new bin covers two old ones), so no counts are smeared.
    """

    def __init__(self, bins: int, signed: bool) -> None:
        if bins < 4 or bins % 4:
            raise LlmoptError(f"histogram bins must be a positive multiple of 4, got {bins}")
        self.bins = bins
        self.signed = signed
        self.range = 0.0
        self.counts = torch.zeros(bins, dtype=torch.float64)
        self.total = 0

    def _grow_to(self, needed: float) -> None:
        if self.range == 0.0:
            self.range = needed if needed > 0 else 1e-12
            return
        while self.range < needed:
            c = self.counts.view(-1, 2).sum(1)
            if self.signed:
                # [-R, R] -> [-2R, 2R]: old bins land in the middle half of the new range
                q = self.bins // 4
                new = torch.zeros_like(self.counts)
                new[q : q + self.bins // 2] = c
            else:
                # [0, R] -> [0, 2R]: old bins land in the lower half
                new = torch.zeros_like(self.counts)
                new[: self.bins // 2] = c
            self.counts = new
            self.range *= 2

    def add(self, x: torch.Tensor) -> None:
        v = x.detach().float().reshape(-1).cpu()
        if v.numel() == 0:
            return
        if not self.signed:
            v = v.abs()
        need = float(v.abs().max())
        self._grow_to(need)
        lo = -self.range if self.signed else 0.0
        self.counts += torch.histc(v, bins=self.bins, min=lo, max=self.range).double()
        self.total += v.numel()

    @property
    def edges(self) -> torch.Tensor:
        lo = -self.range if self.signed else 0.0
        return torch.linspace(lo, self.range, self.bins + 1, dtype=torch.float64)

    def centers(self) -> torch.Tensor:
        e = self.edges
        return (e[:-1] + e[1:]) / 2


class PercentileObserver(Observer):
    """|x| at a percentile (default 99.9) from a fixed-size histogram; ignores rare outliers.

    compute() returns (-a, a). Resolution is range / bins, with linear interpolation inside a bin.
    """

    def __init__(self, percentile: float = 99.9, bins: int = 2048) -> None:
        if not 0 < percentile <= 100:
            raise LlmoptError(f"percentile must be in (0, 100], got {percentile}")
        self.percentile = percentile
        self.hist = _GrowingHistogram(bins, signed=False)

    def update(self, x: torch.Tensor) -> None:
        self.hist.add(x)

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._require(self.hist.total > 0)
        h = self.hist
        target = self.percentile / 100.0 * h.total
        cum = torch.cumsum(h.counts, 0)
        i = int(torch.searchsorted(cum, torch.tensor([target], dtype=torch.float64)).item())
        i = min(i, h.bins - 1)
        before = float(cum[i - 1]) if i > 0 else 0.0
        inside = float(h.counts[i])
        frac = (target - before) / inside if inside > 0 else 1.0
        width = h.range / h.bins
        a = torch.tensor(width * (i + min(max(frac, 0.0), 1.0)), dtype=torch.float32)
        return -a, a


class MseObserver(Observer):
    """Clip range minimizing Σ|x − Q(x)|^norm, searched on a signed histogram of everything seen.

    Like the GPTQ reference quantizer's search: shrink [min, max] by 1 − k/grid for
    k < maxshrink·grid and keep the best, here weighting each histogram bin center by its count so
    memory stays constant. Q is the int quantizer of `scheme` (default int8 symmetric).
    """

    def __init__(
        self,
        scheme: QuantScheme | None = None,
        maxshrink: float = 0.8,
        grid: int = 100,
        norm: float = 2.4,
        bins: int = 2048,
    ) -> None:
        self.scheme = scheme or QuantScheme(bits=8, group_size=-1, symmetric=True, scale_dtype="float32")
        self.maxshrink = maxshrink
        self.grid = grid
        self.norm = norm
        self.hist = _GrowingHistogram(bins, signed=True)
        self._minmax = MinMaxObserver()

    def update(self, x: torch.Tensor) -> None:
        self.hist.add(x)
        self._minmax.update(x)

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._require(self.hist.total > 0)
        xmin, xmax = self._minmax.compute()
        centers = self.hist.centers().float()
        weight = self.hist.counts.float()
        keep = weight > 0
        centers, weight = centers[keep], weight[keep]
        p = 1 - torch.arange(int(self.maxshrink * self.grid), dtype=torch.float32) / self.grid
        scale, zero = params_from_range(p * xmin, p * xmax, self.scheme)  # [k]
        deq = fake_quantize(centers[None, :], scale[:, None], zero[:, None], self.scheme.maxq)
        err = ((deq - centers[None, :]).abs().pow(self.norm) * weight[None, :]).sum(1)
        k = int(torch.argmin(err))  # first minimum: prefers the widest range on ties
        return p[k] * xmin, p[k] * xmax


class ChannelStats:
    """Per-input-channel |x| statistics of one linear: absmax and mean (AWQ's x_mean)."""

    def __init__(self, in_features: int) -> None:
        self.in_features = in_features
        self._absmax = torch.zeros(in_features, dtype=torch.float32)
        self._sum_abs = torch.zeros(in_features, dtype=torch.float64)
        self.count = 0

    def update(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.in_features:
            raise LlmoptError(f"ChannelStats got {x.shape[-1]} channels, expected {self.in_features}")
        a = x.detach().reshape(-1, self.in_features).abs().float()
        if a.shape[0] == 0:
            return
        self._absmax = torch.maximum(self._absmax, a.amax(0).cpu())
        self._sum_abs += a.sum(0, dtype=torch.float64).cpu()
        self.count += a.shape[0]

    def merge(self, other: ChannelStats) -> None:
        """Combine with stats gathered elsewhere (another process or shard)."""
        if other.in_features != self.in_features:
            raise LlmoptError("cannot merge ChannelStats of different widths")
        self._absmax = torch.maximum(self._absmax, other._absmax)
        self._sum_abs += other._sum_abs
        self.count += other.count

    @property
    def absmax(self) -> torch.Tensor:
        return self._absmax.clone()

    @property
    def mean_abs(self) -> torch.Tensor:
        if self.count == 0:
            raise LlmoptError("ChannelStats has seen no tokens")
        return (self._sum_abs / self.count).float()
