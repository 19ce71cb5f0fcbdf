"""`--scheme auto` against uniform 4-bit and 8-bit schemes on the same model, calibration and held-out text.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/auto_precision.py [--model smollm2-135m]
        [--budgets 4.5,4.75,5.5] [--num-samples 16] [--tokens 16384] [--json F]

Every variant is quantized from the same calibration windows (the shipped general_prose.jsonl and
kb_calibration.jsonl mixed 1:1, seed 0, --num-samples windows of 512 tokens) and scored on held-out text:
the first --tokens tokens of ../shared/data/wikitext2-valid.txt, in windows of 512, through our engine in
float32 (`llmopt eval --ppl-data ... --seq-len 512 --max-tokens N --dtype float32` does the same). Columns:
the average stored bits per weight of the decoder's linears (scales and zero points included), the whole
checkpoint's bytes (embedding and head as the source stores them), the perplexity and its increase over
the unquantized model, and for `auto` rows the KL the search predicted and the KL it measured on its
calibration sample. Checkpoints are deleted once scored.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from llmopt import LLM
from llmopt.engine.scoring import token_logprobs
from llmopt.quant.pipeline import quantize_model
from llmopt.quant.recipe import QuantizeConfig

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext2-valid.txt"
CALIB = [str(ROOT / "calibration_data" / "general_prose.jsonl"), str(ROOT / "calibration_data" / "kb_calibration.jsonl")]
SEQ = 512


def perplexity(model: str, tokens: int) -> float:
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64)
    ids = llm.get_tokenizer()(WIKITEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    ids = ids[: (min(tokens, len(ids)) // SEQ) * SEQ]
    nll = -torch.cat(token_logprobs(llm.engine, [ids[i:i + SEQ] for i in range(0, len(ids), SEQ)])).double().mean()
    del llm
    return float(nll.exp())


def linear_bits(model: str, report) -> float:
    """Average stored bits per weight over the decoder linears (scales included), from the model's shapes."""
    if report.auto:
        return report.auto["bits"]
    from llmopt.models.loader import build_empty
    from llmopt.models.resolve import resolve_model
    from llmopt.quant.auto import stored_bits
    from llmopt.quant.recipe import QuantizeConfig

    empty = build_empty(resolve_model(model), torch.float32, "cpu")  # meta tensors: shapes only
    cfg = QuantizeConfig(output=Path("unused"), **{k: v for k, v in report.settings.items() if k != "model"})
    bits = weights = 0.0
    for m in report.modules:
        w = empty.get_submodule(m.module).weight
        gs = cfg.group_size or int(m.scheme.split()[1][1:]) if "channel" not in m.scheme else -1
        bits += stored_bits(cfg.main_scheme(gs), w.shape[1]) * w.numel()
        weights += w.numel()
    return bits / weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budgets", default="4.5,4.75,5.5")
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--only", default="", help="comma list of row names to run (default: all)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    calib = {"calib_data": CALIB, "num_samples": args.num_samples, "seq_len": SEQ, "device": "cpu"}
    variants: dict[str, dict[str, Any]] = {
        "w4a16 g64 RTN": {"scheme": "w4a16", "group_size": 64},
        "w4a16 g32 RTN": {"scheme": "w4a16", "group_size": 32},
        **{f"auto {b} RTN": {"scheme": "auto", "target_bits": float(b), **calib} for b in args.budgets.split(",")[:1]},
        "w4a16 g64 GPTQ": {"scheme": "w4a16", "group_size": 64, "method": "gptq", **calib},
        "w4a16 g32 GPTQ": {"scheme": "w4a16", "group_size": 32, "method": "gptq", **calib},
        "w8a16 RTN": {"scheme": "w8a16"},
        **{f"auto {b} GPTQ": {"scheme": "auto", "target_bits": float(b), "method": "gptq", **calib}
           for b in args.budgets.split(",")},
    }
    only = set(filter(None, args.only.split(",")))
    rows: list[dict[str, Any]] = []
    base = perplexity(args.model, args.tokens)
    print(f"{args.model} unquantized: ppl {base:.3f} on {args.tokens} held-out tokens", flush=True)
    work = Path(tempfile.mkdtemp(prefix="auto-precision-"))
    try:
        for name, opts in variants.items():
            if only and name not in only:
                continue
            out = work / "q"
            t0 = time.perf_counter()
            report = quantize_model(QuantizeConfig(model=args.model, output=out, overwrite=True, **opts))
            seconds = time.perf_counter() - t0
            ppl = perplexity(str(out), args.tokens)
            row = {"variant": name, "bits": round(linear_bits(args.model, report), 4), "bytes": report.bytes_after,
                   "ppl": ppl, "ppl_increase_pct": 100 * (ppl / base - 1), "quantize_s": round(seconds, 1)}
            if report.auto:
                row.update(predicted_kl=report.auto["predicted_kl"], measured_kl=report.auto["measured_kl"],
                           choices=report.auto["choices"])
            rows.append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(out, ignore_errors=True)
            if args.json:
                args.json.write_text(json.dumps({"model": args.model, "base_ppl": base, "rows": rows}, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| variant | bits/weight (linears) | checkpoint | ppl | vs unquantized | KL predicted / measured "
          "(calib.) | quantize s |\n|---|---|---|---|---|---|---|")
    for r in rows:
        kl = f"{r['predicted_kl']:.4f} / {r['measured_kl']:.4f}" if "measured_kl" in r else ""
        print(f"| {r['variant']} | {r['bits']:.3f} | {r['bytes'] / 1e6:.1f} MB | {r['ppl']:.3f} | "
              f"{r['ppl_increase_pct']:+.2f}% | {kl} | {r['quantize_s']:.0f} |")


if __name__ == "__main__":
    main()
