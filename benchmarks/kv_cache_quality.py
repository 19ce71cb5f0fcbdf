"""KV-cache precision against perplexity at long context: float, int8 and fp8, dynamic and calibrated.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/kv_cache_quality.py [--model smollm2-135m]
        [--seq-len 2048] [--tokens 32768] [--dtype float32] [--json F]

Perplexity of the first --tokens tokens of ../shared/data/wikitext2-valid.txt in non-overlapping windows of
--seq-len tokens, scored through the engine, whose quantized caches are read back for every window (the
first chunk included), so the numbers are those a served request sees. Variants: the model's own dtype
(baseline); int8 and fp8 with dynamic per-token, per-head scales; int8 with calibrated static per-head
scales, and fp8 with calibrated static scales per layer and per KV head (compressed-tensors' `kv_cache_scheme`
strategies "tensor" and "attn_head", both of which vLLM loads), all measured by `llmopt quantize --kv-cache
int8|fp8 [--kv-cache-strategy attn_head]` on the shipped calibration texts (general_prose.jsonl +
kb_calibration.jsonl, 16 windows of --seq-len tokens; checkpoints deleted after their scales are read).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from llmopt import LLM
from llmopt.engine.scoring import token_logprobs
from llmopt.loading.formats import kv_cache_scales
from llmopt.models.resolve import resolve_model
from llmopt.quant.pipeline import quantize_model
from llmopt.quant.recipe import QuantizeConfig

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext2-valid.txt"
CALIB = [str(ROOT / "calibration_data" / "general_prose.jsonl"), str(ROOT / "calibration_data" / "kb_calibration.jsonl")]


def calibrated(model: str, kind: str, seq_len: int, strategy: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "q"
        quantize_model(QuantizeConfig(model=model, scheme="w8a16", kv_cache=kind, kv_cache_strategy=strategy,
                                      calib_data=CALIB, num_samples=16, seq_len=seq_len, device="cpu", output=out))
        found = kv_cache_scales(resolve_model(str(out)))
        assert found is not None and found.dtype == kind
        return found.k_scale, found.v_scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    scales = {kind: calibrated(args.model, kind, args.seq_len) for kind in ("int8", "fp8")}
    scales["fp8 per head"] = calibrated(args.model, "fp8", args.seq_len, "attn_head")
    variants = [("model dtype", "auto", None), ("int8, dynamic per token", "int8", None),
                ("fp8, dynamic per token", "fp8", None), ("int8, calibrated per head", "int8", scales["int8"]),
                ("fp8, calibrated per layer", "fp8", scales["fp8"]),
                ("fp8, calibrated per KV head", "fp8", scales["fp8 per head"])]
    rows = []
    base = None
    for name, kv, static in variants:
        llm = LLM(args.model, dtype=args.dtype, device="cpu", kv_cache_dtype=kv,
                  num_kv_blocks=args.seq_len // 16 + 8, max_num_batched_tokens=args.seq_len)
        if static is not None:
            llm.engine.kv_cache.set_static_scales(*static)
        ids = llm.get_tokenizer()(WIKITEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        ids = ids[: (min(args.tokens, len(ids)) // args.seq_len) * args.seq_len]
        windows = [ids[i:i + args.seq_len] for i in range(0, len(ids), args.seq_len)]
        nll = -torch.cat(token_logprobs(llm.engine, windows)).double().mean()
        ppl = float(nll.exp())
        base = ppl if base is None else base
        rows.append({"kv_cache": name, "ppl": ppl, "increase_pct": 100 * (ppl / base - 1), "tokens": len(ids)})
        print(json.dumps(rows[-1]), flush=True)
        del llm
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "seq_len": args.seq_len, "dtype": args.dtype,
                                         "rows": rows}, indent=2))
    print(f"\n{args.model}, {args.dtype} weights, windows of {args.seq_len} tokens, {rows[0]['tokens']} tokens\n")
    print("| KV cache | perplexity | vs model dtype |\n|---|---|---|")
    for r in rows:
        print(f"| {r['kv_cache']} | {r['ppl']:.4f} | {r['increase_pct']:+.3f}% |")


if __name__ == "__main__":
    main()
