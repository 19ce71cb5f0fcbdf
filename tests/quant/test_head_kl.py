"""The auto search's head stage (llmopt/quant/head_kl.py): an untied head held in its checkpoint's dtype gives
the float32 head's next-token distributions, Fisher traces and KLs, in half the head's memory."""

from __future__ import annotations

import pytest
import torch

from llmopt.models.loader import build_empty, fill_module, release
from llmopt.models.reader import CheckpointTensors
from llmopt.models.resolve import resolve_model, weights_dir
from llmopt.quant.head_kl import HeadAccess, fisher_trace, head_product, log_probs, mean_kl
from llmopt.quant.recipe import HEAD_SCHEMES
from llmopt.testing.tiny_model import write_tiny_gemma3, write_tiny_llama


def _streamed(directory):
    """An empty float32 model of `directory` and its load / release, as the quantize pipeline streams it."""
    resolved = resolve_model(str(directory))
    model = build_empty(resolved, torch.float32, "cpu")
    tensors = CheckpointTensors(weights_dir(resolved))
    return model, tensors, (lambda p: fill_module(model, tensors, p, "cpu")), (lambda p: release(model, p))


@pytest.fixture(scope="module")
def bf16_untied(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("bf16-untied"), dtype="bfloat16", tie_word_embeddings=False,
                            hidden_size=256, intermediate_size=64)


def test_an_untied_head_is_held_in_its_checkpoint_dtype_and_given_back(bf16_untied):
    from llmopt.quant.pipeline import _head_dtype

    model, tensors, load, rel = _streamed(bf16_untied)
    assert _head_dtype(model, tensors) == torch.bfloat16
    own = model.lm_head.weight
    with HeadAccess(model, load, rel, torch.bfloat16).loaded():
        assert model.lm_head.weight.dtype == torch.bfloat16 and not model.lm_head.weight.is_meta
        assert model.norm.weight.dtype == torch.float32
        assert torch.equal(model.lm_head.weight, tensors.get("lm_head.weight"))
    assert model.lm_head.weight is own and own.is_meta and own.dtype == torch.float32
    assert model.norm.weight.is_meta
    with HeadAccess(model, load, rel).loaded():  # no dtype given: the model's own
        assert model.lm_head.weight.dtype == torch.float32


def test_the_held_head_gives_the_float32_heads_fisher_and_kl(bf16_untied, monkeypatch):
    import llmopt.quant.qtensor as qtensor

    monkeypatch.setattr(qtensor, "BLOCK_ELEMENTS", 100 * 256)  # blocks of 100 vocabulary rows, the last shorter
    model, _, load, rel = _streamed(bf16_untied)
    torch.manual_seed(0)
    reference = torch.randn(300, 256)  # more tokens than one chunk of the head's work
    stream = reference + 0.3 * torch.randn_like(reference)
    int8_head = HEAD_SCHEMES["int8"]  # `--lm-head auto`'s int8 candidate: rounded as the export rounds it
    got = {}
    for dtype in (None, torch.bfloat16):
        with HeadAccess(model, load, rel, dtype).loaded():
            got[dtype] = (fisher_trace(model, reference), mean_kl(model, reference, stream),
                          mean_kl(model, reference, reference, int8_head))
    (f32_fisher, f32_kl, f32_head_kl), (fisher, kl, head_kl) = got[None], got[torch.bfloat16]
    assert fisher.shape == (300,) and bool((fisher > 0).all())
    # the same sampled tokens but where a draw falls within float32 rounding of a boundary
    assert (~torch.isclose(fisher, f32_fisher, rtol=1e-4)).float().mean() < 0.01
    assert kl == pytest.approx(f32_kl, rel=1e-4) and kl > 0
    assert head_kl == pytest.approx(f32_head_kl, rel=1e-3) and head_kl > 0


def test_the_held_head_needs_half_the_memory(bf16_untied, monkeypatch):
    """The head's product widens a block of rows at a time, in the Fisher's backward too: the head stage's new
    allocations are about the bf16 head, where they were the float32 head."""
    import llmopt.quant.qtensor as qtensor
    from llmopt.testing.live_bytes import LiveTensorBytes

    monkeypatch.setattr(qtensor, "BLOCK_ELEMENTS", 1 << 14)  # blocks of 64 rows of this head
    model, tensors, load, rel = _streamed(bf16_untied)
    stream = torch.randn(4, 256)
    peaks = {}
    for dtype in (None, torch.bfloat16):
        with LiveTensorBytes() as m, HeadAccess(model, load, rel, dtype).loaded():
            fisher_trace(model, stream)
        peaks[dtype] = m.peak
    head_f32 = tensors.get("lm_head.weight").numel() * 4
    assert peaks[None] >= head_f32
    assert peaks[torch.bfloat16] <= peaks[None] - 0.4 * head_f32, (peaks, head_f32)


def test_a_held_heads_logits_are_finished_by_the_family(tmp_path):
    """Gemma's soft cap applies to logits the widened product makes, as to the model's own."""
    d = write_tiny_gemma3(tmp_path / "capped", num_layers=1, final_logit_softcapping=0.5)
    model, _, load, rel = _streamed(d)
    h = torch.randn(5, model.spec.hidden_size)
    with HeadAccess(model, load, rel).loaded():
        weight = model.lm_head.weight
        float_head = weight.data
        weight.data = float_head.to(torch.bfloat16)
        widened = head_product(model, h)
        weight.data = weight.data.float()  # the same values, in float32: the model's own product
        expected = model.compute_logits(h)
        weight.data = float_head
    assert widened.abs().max() <= 0.5  # the cap is in effect
    torch.testing.assert_close(widened, expected, rtol=1e-5, atol=1e-6)


def _fisher_by_autograd(model, stream):
    """The textbook estimate: autograd through the whole head once per sampled token (the search's code before
    session 41), with the same draws."""
    from llmopt.quant.head_kl import CHUNK, FISHER_SAMPLES

    gen = torch.Generator().manual_seed(0)
    out = []
    for lo in range(0, stream.shape[0], CHUNK):
        s = stream[lo:lo + CHUNK].clone().requires_grad_(True)
        logp = torch.log_softmax(model.compute_logits(model.norm(s)), dim=-1)
        ys = torch.multinomial(logp.detach().exp(), FISHER_SAMPLES, replacement=True, generator=gen)
        total = torch.zeros(s.shape[0])
        for k in range(FISHER_SAMPLES):
            (g,) = torch.autograd.grad(logp.gather(1, ys[:, k:k + 1]).sum(), s, retain_graph=True)
            total += g.pow(2).sum(-1)
        out.append(total / FISHER_SAMPLES)
    return torch.cat(out)


@pytest.mark.parametrize("family", ["llama", "gemma3-capped"])
def test_the_fisher_trace_is_autograds(family, tmp_path):
    """The search's Fisher trace takes the head backward once for all samples (c_y·W_y − (c⊙p)·W): the same
    per-token values as autograd through log_softmax, the soft cap's derivative included."""
    if family == "llama":
        d = write_tiny_llama(tmp_path / "m", tie_word_embeddings=False)
    else:
        d = write_tiny_gemma3(tmp_path / "m", num_layers=1, final_logit_softcapping=2.0)
    model, _, load, rel = _streamed(d)
    torch.manual_seed(1)
    stream = 3 * torch.randn(300, model.spec.hidden_size)
    with HeadAccess(model, load, rel).loaded():
        got = fisher_trace(model, stream)
        expected = _fisher_by_autograd(model, stream)
    assert bool((expected > 0).all())
    assert (~torch.isclose(got, expected, rtol=1e-4)).float().mean() < 0.01


@pytest.mark.parametrize("held", [None, torch.bfloat16])
def test_a_rounded_heads_kl_widens_its_codes_a_block_at_a_time(bf16_untied, monkeypatch, held):
    """`--lm-head auto`'s candidates: the KL of the head rounded as the export rounds it is the one its float32
    dequantized copy swapped into the model gives (the search's way before), without that copy (2.1 GB at 8B)."""
    import llmopt.quant.qtensor as qtensor
    from llmopt.quant.rtn import rtn_quantize
    from llmopt.testing.live_bytes import LiveTensorBytes

    monkeypatch.setattr(qtensor, "BLOCK_ELEMENTS", 1 << 12)  # blocks of 16 rows of this head
    model, _, load, rel = _streamed(bf16_untied)
    torch.manual_seed(2)
    reference = torch.randn(8, 256)
    out = {}
    with HeadAccess(model, load, rel, held).loaded():
        weight = model.lm_head.weight
        kept = weight.data
        for name in ("int8", "int4"):
            with LiveTensorBytes() as m:
                got = mean_kl(model, reference, reference, HEAD_SCHEMES[name])
            p = log_probs(model, reference)
            weight.data = rtn_quantize(kept, HEAD_SCHEMES[name].weights).dequantize(torch.float32)
            q = log_probs(model, reference)
            weight.data = kept
            out[name] = (got, float((p.exp() * (p - q)).sum(-1).mean()), m.peak)
    head_f32, held_bytes = kept.numel() * 4, kept.numel() * kept.element_size()
    for name, (got, expected, peak) in out.items():
        assert got == pytest.approx(expected, rel=1e-3) and got > 0, name
        # beyond the head itself: its codes and a block's temporaries (0.50-0.53 of the float32 head here),
        # where the float32 copy made it 1.37
        assert peak <= held_bytes + 0.7 * head_f32, (name, peak, held_bytes, head_f32)
    assert out["int4"][0] > out["int8"][0]
