"""W8A8 runtime linear: int8 weights (per output channel) times int8 activations quantized per token.

    y = (x_q · W_qᵀ) · s_x[:, None] · s_w[None, :]
    s_x = absmax_token(x) / 127.5  (0 → float32 eps),   x_q = round_half_even(clamp(x / s_x, −128, 127))

Activation rounding follows compressed-tensors, the reference implementation of the format our W8A8
checkpoints declare (`input_activations: {type: int, num_bits: 8, symmetric, strategy: token,
dynamic: true}`), which transformers runs: `calculate_qparams` (quantization/utils/helpers.py) takes
scale = max(|min|, |max|) / ((q_max − q_min) / 2) with q_min, q_max = −128, 127 (`calculate_range`),
replaces a zero scale by the scale dtype's eps, and `round_to_quantized_type_args`
(quantization/quant_args.py) clamps x / scale to [−128, 127] and rounds half to even — so a
token's largest positive value maps to 127 and its largest negative one to −128. For float32 inputs
`quantize_per_token` is bit-exact with that (tests/quant/test_quant_dynamic_int8.py); for bf16 inputs
we keep the scale and x / scale in float32 where compressed-tensors rounds them to bf16.
vLLM's int8 kernels (CUDA and CPU `dynamic_scaled_int8_quant`) use absmax / 127 instead, so their
codes differ from these by at most one step on some elements; no stored tensor depends on the choice.

The int8 × int8 → int32 product runs on `torch._int_mm` (CPU and CUDA in torch 2.13; CUDA needs
M > 16 and K, N multiples of 8, so small decode batches are padded). Where it is unavailable or fails
its one-time self-check, the same product is emulated in float32 on the int8 values (exact while
K·128·127 < 2²⁴, i.e. K ≤ 1032; beyond that it rounds like an fp32 accumulator would) — the numerics
are those of W8A8 either way, only the speed differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmopt.errors import LlmoptError
from llmopt.quant.linear import _QuantLinear
from llmopt.quant.qtensor import QuantizedWeight

INT8_MIN = -128.0
INT8_MAX = 127.0
# compressed-tensors' symmetric scale divisor: (q_max − q_min) / 2 = 127.5
ACT_SCALE_DIVISOR = (INT8_MAX - INT8_MIN) / 2
_FP32_EPS = torch.finfo(torch.float32).eps


def quantize_per_token(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of `x2` [M, K]: (codes int8 [M, K], scales float32 [M, 1]).

    Rounding as compressed-tensors does for dynamic token-wise int8 (see module doc): x ≈ codes · scale.
    """
    xf = x2.float()
    scale = xf.abs().amax(dim=1, keepdim=True) / ACT_SCALE_DIVISOR
    scale = torch.where(scale == 0, torch.full_like(scale, _FP32_EPS), scale)
    return torch.round(torch.clamp(xf / scale, INT8_MIN, INT8_MAX)).to(torch.int8), scale


class Int8DynamicActivationLinear(_QuantLinear):
    """Symmetric per-channel int8 weights and per-token dynamic int8 activations (SmoothQuant W8A8)."""

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                       compute_dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None) -> Int8DynamicActivationLinear:
        s = qw.scheme
        if s.kind != "int" or s.bits != 8 or not s.symmetric or qw.n_groups != 1:
            raise LlmoptError(f"W8A8 needs symmetric per-channel int8 weights, got {s.describe()}")
        m, qw = cls._create(qw, bias, compute_dtype, device)
        # signed codes, transposed once: _int_mm wants [K, N] for the right operand
        m.register_buffer("weight_t", (qw.q.to(torch.int16) - 128).to(torch.int8).t().contiguous())
        m.register_buffer("weight_scale", qw.scale[:, 0].float().contiguous())
        m.mode = "int_mm"
        if not m._int_mm_works():
            m.mode = "emulated"
        return m

    def _int_mm_works(self) -> bool:
        x = torch.randint(-127, 128, (17, self.in_features), dtype=torch.int8, device=self.weight_t.device)
        try:
            got = self._int_mm(x)
        except RuntimeError:
            return False
        return torch.equal(got, self._emulated(x))

    def _int_mm(self, xq: torch.Tensor) -> torch.Tensor:
        m = xq.shape[0]
        if xq.device.type == "cuda" and m <= 16:
            xq = F.pad(xq, (0, 0, 0, 17 - m))
        return torch._int_mm(xq, self.weight_t)[:m]

    def _emulated(self, xq: torch.Tensor) -> torch.Tensor:
        return (xq.float() @ self.weight_t.float()).round().to(torch.int32)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] (activation rounding is applied per call, not here)."""
        return self.weight_t.t().float() * self.weight_scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = self._prepare(x)
        xq, xs = quantize_per_token(x2)
        acc = self._int_mm(xq) if self.mode == "int_mm" else self._emulated(xq)
        y = (acc.float() * xs * self.weight_scale[None, :]).to(self.compute_dtype)
        return self._finish(y, x)
