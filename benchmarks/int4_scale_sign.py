"""Why llama.cpp's Q4_0 beat our symmetric int4 g32 in the same 4.5 bits (issue #32): the sign of the scale.

Our symmetric int4 groups mapped the weight range onto the codes [-8, 7] with a positive scale, max(-min/8, max/7)
(until session 25; `rtn.params_from_range` now takes Q4_0's rule below): a group whose largest-magnitude weight
is positive got only 7 steps up to it. llama.cpp's Q4_0 takes
d = (the signed extreme) / -8, negative for such a group, so the extreme always lands on code -8 and every group
gets 8 steps of |d| = |extreme| / 8 (and a weight on the other side past 7·|d| is clipped to it). A third way
takes the smaller step of the two signs that clips nothing. This fake-quantizes every decoder linear of SmolLM2 each way by plain round
to nearest (groups of 32, fp16 scales) and scores held-out perplexity with transformers in float32.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/int4_scale_sign.py
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from llmopt.quant.rtn import fake_quantize

ROOT = Path(__file__).resolve().parents[1]
TEXTS = {"wikitext2": ROOT.parent / "shared/data/wikitext2-valid.txt",
         "tinyshakespeare": ROOT.parent / "shared/data/tinyshakespeare.txt"}


def positive_scale(g: torch.Tensor) -> torch.Tensor:
    """llmopt's symmetric int4 before session 25, per group of `g` [rows, groups, size]."""
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    s = torch.maximum(-lo / 8, hi / 7)
    return torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group: scale 1, as params_from_range


def signed_scale(g: torch.Tensor) -> torch.Tensor:
    """Q4_0's: the signed extreme on code -8 (rtn.params_from_range's int4 rule now, which rounds the scale up
    to fp16 where this rounds it to nearest, and sends a tie between the two sides to the negative one)."""
    extreme = g.gather(-1, g.abs().argmax(-1, keepdim=True))
    return torch.where(extreme == 0, torch.ones_like(extreme), extreme / -8)


def either_sign(g: torch.Tensor) -> torch.Tensor:
    """The smaller step of the two signs that clips nothing: max(-min/8, max/7) positive or max(max/8, -min/7)
    negative (the extreme on -8 unless the other side would then pass +7)."""
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    pos, neg = torch.maximum(-lo / 8, hi / 7), torch.maximum(hi / 8, -lo / 7)
    s = torch.where(neg < pos, -neg, pos)
    return torch.where(s == 0, torch.ones_like(s), s)


def round_int4(w: torch.Tensor, group: int, scale_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`w` rounded to nearest in int4 groups of `group` (codes [-8, 7]) with fp16 scales from `scale_of`."""
    g = w.reshape(w.shape[0], -1, group)
    return fake_quantize(g, scale_of(g).half().float(), torch.tensor(8.0), 15).reshape(w.shape)


def perplexity(model, ids: list[int], seq: int = 512) -> float:
    windows = torch.tensor(ids[: len(ids) // seq * seq]).reshape(-1, seq)
    with torch.no_grad():
        nll = sum(model(w[None], labels=w[None]).loss.item() for w in windows)
    return float(torch.tensor(nll / len(windows)).exp())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--group", type=int, default=32)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmopt.models.resolve import resolve_model, weights_dir

    path = weights_dir(resolve_model(args.model))
    tok = AutoTokenizer.from_pretrained(path)
    ids = {n: tok(p.read_text(encoding="utf-8")[: 50 * args.tokens])["input_ids"][: args.tokens] for n, p in TEXTS.items()}
    for name, fq in (("positive scale (llmopt before)", positive_scale), ("signed scale (Q4_0, llmopt now)", signed_scale),
                     ("either sign, no clipping", either_sign)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            for n, mod in model.named_modules():
                if isinstance(mod, torch.nn.Linear) and ".layers." in f".{n}":
                    mod.weight.copy_(round_int4(mod.weight.float(), args.group, fq))
        print(f"{name}: " + ", ".join(f"{n} {perplexity(model, v):.3f}" for n, v in ids.items()), flush=True)


if __name__ == "__main__":
    main()
