"""Next-token distributions from final residual streams, for the auto search: log-probs, the Fisher trace, KL.

The search streams a model built in float32 one module at a time, and these are the steps that need the final
norm and the head. `HeadAccess` fills them for a block of work and gives them back after. An untied head is held
in its checkpoint's dtype, and its products taken in float32 by blocks of vocabulary rows widened one at a time
(`raw_logits`): at Llama-3-8B's 128k vocabulary a float32 head is 2.1 GB, the search's peak at that shape
(docs/BENCHMARKS.md, "where `--scheme auto` held its extra memory"), against 1.05 GB in bf16. Each widened
block is exact, so the logits are those of the float32 head up to the order of float32 sums.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmopt.models.base import CausalLM
from llmopt.quant.qtensor import QuantizedWeight, row_blocks
from llmopt.quant.recipe import ModuleScheme
from llmopt.quant.rtn import rtn_quantize

FISHER_SAMPLES = 4  # sampled next tokens per position for tr F_t
CHUNK = 256  # tokens per head evaluation (a 262k vocabulary: 256 MB of float32 logits)


class HeadAccess:
    """The final norm and the head, filled by `load(prefix)` for the duration of `with access.loaded():` and
    given back by `release(prefix)` after (a tied head is the embedding, in the model's dtype). An untied head
    is filled in `head_dtype` (its checkpoint's) where that is narrower than the model's."""

    def __init__(self, model: CausalLM, load: Callable[[str], None], release: Callable[[str], None],
                 head_dtype: torch.dtype | None = None) -> None:
        self.model, self.load, self.release = model, load, release
        self.head_dtype = head_dtype

    @contextmanager
    def loaded(self) -> Iterator[None]:
        model = self.model
        tied = model.spec.tie_word_embeddings
        parts = ["norm", "embed_tokens" if tied else "lm_head"]
        kept = None
        w = model.lm_head.weight
        if not tied and self.head_dtype is not None and w.is_meta and self.head_dtype.itemsize < w.dtype.itemsize:
            kept = w  # the model's own (meta) parameter, put back after
            narrow = torch.empty_like(w, dtype=self.head_dtype)  # on meta: `load` fills it in this dtype
            model.lm_head.weight = nn.Parameter(narrow, requires_grad=w.requires_grad)
        try:
            for p in parts:
                self.load(p)
            yield
        finally:
            for p in parts:
                self.release(p)
            if kept is not None:
                model.lm_head.weight = kept


def _widened_blocks(weight: torch.Tensor | QuantizedWeight) -> Iterator[tuple[slice, torch.Tensor]]:
    if isinstance(weight, QuantizedWeight):
        for rows in row_blocks(weight.out_features, weight.in_features):
            yield rows, weight.dequantize_rows(rows)
        return
    for rows in row_blocks(*weight.shape):
        yield rows, weight[rows].float()


def _held(model: CausalLM, x: torch.Tensor) -> bool:
    """Whether the head is held in another dtype than the float32 `x` it multiplies (its products then go by
    widened blocks)."""
    return model.lm_head.weight.dtype != x.dtype


def raw_logits(model: CausalLM, hidden: torch.Tensor, rounded: QuantizedWeight | None = None) -> torch.Tensor:
    """The head's product of `hidden` [T, d] (norm applied) in float32, before the family's `finish_logits`;
    with the head's codes `rounded` in place of its weight if given (widened a block of rows at a time: a float32
    copy of an 8B model's rounded head is 2.1 GB)."""
    head = model.lm_head
    if rounded is None and not _held(model, hidden):
        return head(hidden).float()
    out = hidden.new_empty(hidden.shape[0], head.weight.shape[0], dtype=torch.float32)
    for rows, w in _widened_blocks(head.weight if rounded is None else rounded):
        out[:, rows] = hidden.float() @ w.t()
    return out if getattr(head, "bias", None) is None else out.add_(head.bias.float())


def _times_head(model: CausalLM, grad: torch.Tensor) -> torch.Tensor:
    """grad [T, V] @ W: the head's product taken backward, to the hidden state (float32)."""
    if not _held(model, grad):
        return grad @ model.lm_head.weight
    out = None
    for rows, w in _widened_blocks(model.lm_head.weight):
        part = grad[:, rows] @ w
        out = part if out is None else out.add_(part)
    return out


def head_product(model: CausalLM, hidden: torch.Tensor, rounded: QuantizedWeight | None = None) -> torch.Tensor:
    """The model's float32 logits of `hidden` [T, d] (norm applied), its head loaded: `compute_logits`'s, the
    head's product taken as `raw_logits` takes it."""
    return model.finish_logits(raw_logits(model, hidden, rounded))


def log_probs(model: CausalLM, stream: torch.Tensor, rounded: QuantizedWeight | None = None) -> torch.Tensor:
    """log p(· | stream_t) for each row of a final residual stream [T, d] (the head `rounded` if given)."""
    h = model.norm(stream.to(model.norm.weight.dtype))
    return F.log_softmax(head_product(model, h, rounded).float(), dim=-1)


@torch.no_grad()
def fisher_trace(model: CausalLM, stream: torch.Tensor) -> torch.Tensor:
    """tr F_t of log p(· | stream_t) with respect to stream_t, per token: E_{y~p}‖∇ log p_y‖², estimated from
    `FISHER_SAMPLES` sampled y (a fixed seed). The norm and head loaded.

    The gradient of log p_y with respect to the head's input is c_y·W_y − (c⊙p)·W, c the derivative of the
    family's `finish_logits` (element-wise: 1, or Gemma's soft cap), so the head's product is taken backward
    once per chunk of tokens for every sample, not once per sample (two passes over the head where autograd
    made five); only the norm's backward runs per sample."""
    gen = torch.Generator().manual_seed(0)
    weight = model.lm_head.weight
    out = []
    for lo in range(0, stream.shape[0], CHUNK):
        s = stream[lo:lo + CHUNK].detach().clone().requires_grad_(True)
        with torch.enable_grad():
            h = model.norm(s.to(model.norm.weight.dtype))
            z = raw_logits(model, h.detach()).requires_grad_(True)
            logits = model.finish_logits(z)
            (c,) = torch.autograd.grad(logits.sum(), z)
        p = torch.softmax(logits.detach(), dim=-1)
        ys = torch.multinomial(p.cpu(), FISHER_SAMPLES, replacement=True, generator=gen).to(p.device)
        shared = _times_head(model, c * p)
        del p
        total = torch.zeros(s.shape[0], device=s.device)
        for k in range(FISHER_SAMPLES):
            y = ys[:, k]
            grad_h = c.gather(1, y[:, None]) * weight[y].float() - shared
            (g,) = torch.autograd.grad(h, s, grad_outputs=grad_h.to(h.dtype), retain_graph=k + 1 < FISHER_SAMPLES)
            total += g.float().pow(2).sum(-1)
        out.append((total / FISHER_SAMPLES).cpu())
    return torch.cat(out)


@torch.no_grad()
def mean_kl(model: CausalLM, reference: torch.Tensor, stream: torch.Tensor,
            head: ModuleScheme | None = None) -> float:
    """Mean KL(p ‖ q) per token between the next-token distributions of two final residual streams (the
    final norm and head loaded); q's head rounded to `head` (by RTN, as the export rounds it) if given, its codes
    widened to float32 a block at a time whatever the head is held in (int8 codes times their scales need more
    bits than bf16 keeps: the KL of an int8 head came out 9% off in bf16)."""
    rounded = None if head is None else rtn_quantize(model.lm_head.weight.data, head.weights)
    total = 0.0
    for lo in range(0, reference.shape[0], CHUNK):
        p = log_probs(model, reference[lo:lo + CHUNK])
        q = log_probs(model, stream[lo:lo + CHUNK], rounded)
        total += float((p.exp() * (p - q)).sum())
    return total / reference.shape[0]
