"""GPTQ checkpoint tensors (the layout transformers/optimum, GPTQModel, AutoGPTQ and vLLM read).

Per quantized linear `<name>`:

* `<name>.qweight` int32 [in·bits/32, out]: codes packed along the *input* dim, LSB first
  (input row r = 32/bits·i + j sits in bits [j·bits, (j+1)·bits) of qweight[i]).
* `<name>.qzeros`  int32 [n_groups, out·bits/32]: zero points packed along the *output* dim, LSB
  first, in the v1 convention stored = zero − 1. Symmetric weights store 2^(bits−1) − 1
  (7 for int4, 127 for int8), i.e. an effective zero of 2^(bits−1).
* `<name>.scales`  fp16 [n_groups, out].
* `<name>.g_idx`   int32 [in]: group of each input row (i // group_size unless act-order).

Dequantization: w[o, i] = (code[i, o] − (qzeros_unpacked[g_idx[i], o] + 1)) · scales[g_idx[i], o].
"""

from __future__ import annotations

from typing import Any

import torch

from llmopt._version import __version__
from llmopt.errors import LlmoptError
from llmopt.quant.packing import pack_int32, unpack_int32
from llmopt.quant.qtensor import QuantizedWeight
from llmopt.quant.scheme import QuantScheme

GPTQ_TENSOR_NAMES = ("qweight", "qzeros", "scales", "g_idx")


def _check_packable(out: int, inp: int, bits: int) -> None:
    per = 32 // bits
    if inp % per or out % per:
        raise LlmoptError(
            f"GPTQ int{bits} packing needs in and out features divisible by {per}, got [{out}, {inp}]"
        )


def pack_gptq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """`{qweight, qzeros, scales, g_idx}` for one linear (prefix the keys with the module name)."""
    scheme = qw.scheme
    if scheme.kind != "int":
        raise LlmoptError(f"GPTQ format holds int weights, not {scheme.describe()}")
    bits = scheme.bits
    _check_packable(qw.out_features, qw.in_features, bits)
    if int(qw.q.max()) > scheme.maxq:
        raise LlmoptError(f"codes exceed {bits} bits")
    zeros = qw.zero_points()  # [out, n_groups], effective zero
    if int(zeros.min()) < 1 or int(zeros.max()) > (1 << bits):
        raise LlmoptError(f"GPTQ v1 zeros must lie in [1, {1 << bits}] (stored as zero - 1)")
    qweight = pack_int32(qw.q, bits, dim=1).t().contiguous()  # [in/per, out]
    qzeros = pack_int32((zeros - 1).t(), bits, dim=1)  # [n_groups, out/per]
    scales = qw.scale.t().to(torch.float16).contiguous()
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": qw.g_idx.to(torch.int32).clone()}


def unpack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    sym: bool = True,
) -> QuantizedWeight:
    """Read GPTQ (v1 zeros) tensors back into a QuantizedWeight.

    `sym=True` requires every zero to be 2^(bits-1) (then `zero` is None); otherwise zeros are kept.
    A missing `g_idx` means contiguous groups.
    """
    if bits not in (4, 8):
        raise LlmoptError(f"only 4- and 8-bit GPTQ checkpoints are supported, got bits={bits}")
    per = 32 // bits
    inp = qweight.shape[0] * per
    out = qweight.shape[1]
    n_groups = scales.shape[0]
    q = unpack_int32(qweight.t().contiguous(), bits, dim=1, count=inp)  # [out, in]
    zeros = unpack_int32(qzeros, bits, dim=1, count=out).to(torch.int32).t() + 1  # [out, n_groups]
    gs = inp if group_size == -1 else group_size
    if gs <= 0 or inp % gs or inp // gs != n_groups:
        raise LlmoptError(
            f"GPTQ tensors do not match group_size {group_size}: in_features {inp}, {n_groups} scale groups"
        )
    if g_idx is None:
        g_idx = torch.arange(inp, dtype=torch.int32, device=qweight.device) // gs
    symmetric = False
    if sym:
        if not bool((zeros == (1 << (bits - 1))).all()):
            raise LlmoptError(f"checkpoint says sym=True but its zeros are not all {1 << (bits - 1)}")
        symmetric = True
    scheme = QuantScheme(
        bits=bits, group_size=group_size, symmetric=symmetric, kind="int", scale_dtype="float16"
    )
    return QuantizedWeight(
        q=q,
        scale=scales.t().float().contiguous(),
        zero=None if symmetric else zeros.to(torch.uint8).contiguous(),
        g_idx=g_idx.to(torch.int32),
        scheme=scheme,
    )


def gptq_quantization_config(
    scheme: QuantScheme,
    desc_act: bool = False,
    static_groups: bool = False,
    damp_percent: float = 0.01,
    true_sequential: bool = True,
    lm_head: bool = False,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `quantization_config` entry of config.json for a GPTQ (v1, int32-packed) checkpoint."""
    if scheme.kind != "int":
        raise LlmoptError(f"GPTQ format holds int weights, not {scheme.describe()}")
    cfg: dict[str, Any] = {
        "quant_method": "gptq",
        "bits": scheme.bits,
        "group_size": scheme.group_size,
        "desc_act": desc_act,
        "sym": scheme.symmetric,
        "static_groups": static_groups,
        "true_sequential": true_sequential,
        "damp_percent": damp_percent,
        "lm_head": lm_head,
        "checkpoint_format": "gptq",
        "pack_dtype": "int32",
        "meta": {"quantizer": [f"llmopt:{__version__}"]},
    }
    cfg.update(extra or {})
    return cfg
