from __future__ import annotations

import pytest
import torch

from llmopt.errors import LlmoptError
from llmopt.quant import (
    ChannelStats,
    EmaObserver,
    MinMaxObserver,
    MseObserver,
    PercentileObserver,
    QuantScheme,
    params_from_range,
)


def _batches(n: int = 6) -> list[torch.Tensor]:
    return [torch.randn(4, 10, 16) * (i + 1) for i in range(n)]


def test_minmax_exact_per_tensor_and_per_channel():
    bs = _batches()
    allx = torch.cat([b.reshape(-1, 16) for b in bs])
    obs, pc = MinMaxObserver(), MinMaxObserver(per_channel=True)
    for b in bs:
        obs.update(b)
        pc.update(b)
    lo, hi = obs.compute()
    assert lo == allx.min() and hi == allx.max()
    lo_c, hi_c = pc.compute()
    assert torch.equal(lo_c, allx.amin(0)) and torch.equal(hi_c, allx.amax(0))
    assert obs.absmax() == allx.abs().max()
    with pytest.raises(LlmoptError):
        MinMaxObserver().compute()


def test_ema_follows_its_definition_and_converges():
    c = 0.01
    obs = EmaObserver(averaging_constant=c, per_channel=True)
    bs = _batches(3)
    lo = hi = None
    for b in bs:
        obs.update(b)
        flat = b.reshape(-1, 16)
        if lo is None:
            lo, hi = flat.amin(0), flat.amax(0)
        else:
            lo, hi = lo + c * (flat.amin(0) - lo), hi + c * (flat.amax(0) - hi)
    assert torch.allclose(obs.compute()[0], lo) and torch.allclose(obs.compute()[1], hi)
    # a constant stream of range [-1, 2] pulls an initial outlier range towards it
    ema = EmaObserver(averaging_constant=0.1)
    ema.update(torch.tensor([-50.0, 50.0]))
    for _ in range(200):
        ema.update(torch.tensor([-1.0, 0.5, 2.0]))
    lo_t, hi_t = ema.compute()
    assert abs(float(lo_t) + 1) < 1e-3 and abs(float(hi_t) - 2) < 1e-3


def test_percentile_close_to_torch_quantile_with_growing_range():
    obs = PercentileObserver(percentile=99.9)
    chunks = [torch.randn(20000) * s for s in (0.5, 1.0, 4.0)]  # range grows twice -> re-binning
    chunks.append(torch.distributions.StudentT(3.0).sample((20000,)))
    for ch in chunks:
        obs.update(ch)
    ref = torch.quantile(torch.cat(chunks).abs(), 0.999).item()
    lo, hi = obs.compute()
    assert float(lo) == -float(hi)
    assert abs(float(hi) - ref) / ref < 0.01
    assert obs.hist.counts.sum().item() == 80000


def _power_err(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scheme: QuantScheme) -> float:
    scale, zero = params_from_range(lo, hi, scheme)
    q = torch.clamp(torch.round(x / scale) + zero, 0, scheme.maxq)
    return float(((q - zero) * scale - x).abs().pow(2.4).sum())


@pytest.mark.parametrize("bits, bound", [(8, 1.0), (4, 0.5)])
def test_mse_picks_a_clip_below_max_for_heavy_tails(bits, bound):
    scheme = QuantScheme(bits=bits, group_size=-1, symmetric=True, scale_dtype="float32")
    x = torch.distributions.StudentT(3.0).sample((50000,))
    obs = MseObserver(scheme)
    for ch in x.split(10000):
        obs.update(ch)
    lo, hi = obs.compute()
    amax = float(x.abs().max())
    assert float(torch.maximum(-lo, hi)) < bound * amax
    # the histogram search really lowers the |x - Q(x)|^2.4 error of the raw samples
    assert _power_err(x, lo, hi, scheme) < _power_err(x, x.min(), x.max(), scheme)
    # and keeps (nearly) the full range for a uniform distribution
    u = MseObserver(scheme)
    u.update(torch.rand(20000) * 2 - 1)
    assert float(u.compute()[1]) > 0.9


def test_channel_stats_absmax_and_mean_abs():
    st = ChannelStats(8)
    bs = [torch.randn(3, 5, 8) for _ in range(4)]
    for b in bs:
        st.update(b)
    allx = torch.cat([b.reshape(-1, 8) for b in bs])
    assert torch.equal(st.absmax, allx.abs().amax(0))
    assert torch.allclose(st.mean_abs, allx.abs().mean(0), rtol=1e-5)
    other = ChannelStats(8)
    other.update(torch.full((2, 8), 100.0))
    st.merge(other)
    assert st.count == 62 and float(st.absmax.min()) == 100.0
    with pytest.raises(LlmoptError):
        st.update(torch.randn(2, 7))


def test_ema_matches_torch_ao_moving_average_observer():
    ao = pytest.importorskip("torch.ao.quantization.observer")
    ref = ao.MovingAverageMinMaxObserver(averaging_constant=0.01)
    ours = EmaObserver()
    for i in range(5):
        x = torch.randn(200) * (i + 1)
        ref(x)
        ours.update(x)
    lo, hi = ours.compute()
    assert torch.allclose(lo, ref.min_val) and torch.allclose(hi, ref.max_val)
