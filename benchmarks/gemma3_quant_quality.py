"""Gemma-3-270M quantization quality, and what its 262k-token embedding does to size.

Run: .venv/bin/python benchmarks/gemma3_quant_quality.py [--tokens 4096] [--seq-len 512] [--gptq] [--json F]

Perplexity: the first `--tokens` tokens of ../shared/data/wikitext2-valid.txt in non-overlapping
windows of `<bos>` + `--seq-len` - 1 tokens (the BOS itself is not scored), teacher-forced through `llmopt.engine.scoring` with float32
activations (quantized checkpoints apply their exact dequantized weights), as
benchmarks/quant_quality.py does for SmolLM2. Variants: the fp32 model (the `gemma3-270m` alias, its
Q4_K_M GGUF dequantized), `llmopt quantize` checkpoints W8A16 RTN (per channel) and W4A16 RTN (g128,
symmetric), with `--gptq` also W4A16 GPTQ; and, because llmopt never quantizes embeddings, the tied
embedding/lm_head round-to-nearest quantized in place (int8 per row, int4 g128 per row; simulated:
dequantized fp32 weights), alone and on top of W4A16.
Sizes: bytes of the weights if stored in bf16 / int8 / int4 (+ bf16 group scales), from the parameter
counts; the checkpoints' own file sizes are printed too (llmopt keeps unquantized tensors in the dtype
they were loaded in: fp32 here).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from llmopt import LLM
from llmopt.engine.scoring import token_logprobs
from llmopt.models import resolve_model
from llmopt.quant.pipeline import quantize_model
from llmopt.quant.recipe import QuantizeConfig
from llmopt.quant.rtn import rtn_fake_quantize
from llmopt.quant.scheme import QuantScheme

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext2-valid.txt"
CALIB = [str(ROOT / "calibration_data" / "general_prose.jsonl"), str(ROOT / "calibration_data" / "kb_calibration.jsonl")]
MODEL = "gemma3-270m"


def windows(llm: LLM, tokens: int, seq_len: int) -> list[list[int]]:
    """`<bos>` + the next seq_len - 1 text tokens per window: Gemma is trained with a BOS at the start of
    every sequence (measured at --tokens 4096: fp32 perplexity 32.4 with it, 86.5 with plain 512-token
    windows without it)."""
    tok = llm.get_tokenizer()
    ids = tok(WIKITEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    step = seq_len - 1
    ids = ids[: (min(tokens, len(ids)) // step) * step]
    return [[tok.bos_token_id] + ids[i:i + step] for i in range(0, len(ids), step)]


def perplexity(llm: LLM, seqs: list[list[int]]) -> float:
    nll = -torch.cat(token_logprobs(llm.engine, seqs)).double().mean().item()
    return float(torch.tensor(nll).exp())


def quantize_embedding(llm: LLM, bits: int, group: int) -> None:
    """RTN the (tied) embedding in place: every token row is also an lm_head output row."""
    emb = llm.engine.model.embed_tokens.weight
    with torch.no_grad():
        emb.copy_(rtn_fake_quantize(emb, QuantScheme(bits=bits, group_size=group, symmetric=True)).to(emb.dtype))


def sizes() -> dict[str, int]:
    """Weight bytes per storage choice (int4: 0.5 B/param + a bf16 scale per 128; int8 per row)."""
    s = resolve_model(MODEL).spec
    emb, lin = s.vocab_size * s.hidden_size, s.num_layers * s.layer_linear_params()
    rest = s.num_params() - emb - lin  # norms
    rows = s.num_layers * sum(o for o, _ in s.linear_shapes().values())
    int8_lin, int4_lin = lin + 2 * rows, lin // 2 + 2 * (lin // 128)
    int8_emb, int4_emb = emb + 2 * s.vocab_size, emb // 2 + 2 * (emb // 128)
    return {"params": s.num_params(), "embedding_params": emb, "linear_params": lin,
            "bf16": 2 * (emb + lin + rest),
            "w8a16 (embedding bf16)": int8_lin + 2 * (emb + rest), "w8a16 + int8 embedding": int8_lin + int8_emb + 2 * rest,
            "w4a16 (embedding bf16)": int4_lin + 2 * (emb + rest), "w4a16 + int4 embedding": int4_lin + int4_emb + 2 * rest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--gptq", action="store_true", help="also W4A16 GPTQ (calibrated on general prose + kb, 32 x 512)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/llmopt-gemma3-quality"))
    ap.add_argument("--json", type=Path, default=Path("gemma3_quant_quality.json"))
    args = ap.parse_args()
    results: dict = {"protocol": vars(args) | {"work_dir": str(args.work_dir), "json": str(args.json)},
                     "sizes": sizes(), "ppl": {}, "checkpoint_bytes": {}}

    def record(label: str, llm: LLM, seqs: list[list[int]]) -> None:
        t = time.perf_counter()
        results["ppl"][label] = round(perplexity(llm, seqs), 4)
        base = results["ppl"].get("fp32")
        inc = "" if base is None else f" ({100 * (results['ppl'][label] / base - 1):+.2f}%)"
        print(f"{label}: ppl {results['ppl'][label]}{inc}  [{time.perf_counter() - t:.0f} s]", flush=True)
        args.json.write_text(json.dumps(results, indent=2))

    base = LLM(MODEL, dtype="float32")
    seqs = windows(base, args.tokens, args.seq_len)
    record("fp32", base, seqs)
    quantize_embedding(base, 8, -1)
    record("fp32 + int8 embedding", base, seqs)
    del base
    emb4 = LLM(MODEL, dtype="float32")
    quantize_embedding(emb4, 4, 128)
    record("fp32 + int4 embedding", emb4, seqs)
    del emb4
    variants = [("w8a16 rtn", {"scheme": "w8a16"}), ("w4a16 rtn", {"scheme": "w4a16", "group_size": 128})]
    if args.gptq:
        variants.append(("w4a16 gptq", {"scheme": "w4a16", "group_size": 128, "method": "gptq", "calib_data": CALIB,
                                        "num_samples": 32, "seq_len": 512,
                                        "act_order": False}))  # as measured (docs/BENCHMARKS.md)
    for label, kw in variants:
        out = args.work_dir / label.replace(" ", "-")
        quantize_model(QuantizeConfig(model=MODEL, output=out, overwrite=True, device="cpu",
                                      format="compressed-tensors", **kw))
        results["checkpoint_bytes"][label] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        llm = LLM(str(out), dtype="float32")
        record(label, llm, seqs)
        if label == "w4a16 rtn":
            quantize_embedding(llm, 4, 128)
            record("w4a16 rtn + int4 embedding", llm, seqs)
        del llm
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
