"""Quantization quality and speed on the real SmolLM2-135M, every variant under one protocol, one run.

Run: .venv/bin/python benchmarks/quant_quality.py [--tokens 32768] [--seq-len 512] [--threads 2]

Perplexity: the first `--tokens` tokens of ../shared/data/wikitext2-valid.txt in non-overlapping
`--seq-len` windows, scored teacher-forced through `llmopt.engine.scoring` with float32 activations
(quantized checkpoints apply their exact dequantized weights in fp32; see llmopt/quant/dequantized.py).
Variants: fp32 baseline, W8A16 RTN, W4A16 g64 RTN (sym), W4A16 g64 GPTQ and AWQ (calibrated on
--calib, by default calibration_data/general_prose.jsonl and kb_calibration.jsonl mixed 1:1,
--num-samples × --calib-seq-len), and an INT8 KV cache on the
fp32 model, with calibrated static per-head scales (`llmopt calibrate`) and with the engine's dynamic
per-token scales. Each quantization run is timed (wall and process CPU time: the machine is shared).

Decode speed: one stream, `--decode-tokens` greedy tokens, for the fp32 engine, a dense bf16 engine and
the W8A16 / W4A16 checkpoints with bf16 activations (their default), on `--decode-threads` (1: see its
help); rounds are interleaved and the best of `--rounds` is kept, so the ratios come from the same
moments of a noisy machine.
Prints a markdown table and writes every number to --json as it goes.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path
from typing import Any

import torch

from llmopt import LLM, SamplingParams
from llmopt.calibrate import CalibrateConfig, SavedStats, run_calibration
from llmopt.engine.scoring import token_logprobs
from llmopt.quant.pipeline import quantize_model
from llmopt.quant.recipe import QuantizeConfig

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext2-valid.txt"
KB = ROOT / "calibration_data" / "kb_calibration.jsonl"
GENERAL = ROOT / "calibration_data" / "general_prose.jsonl"
MODEL = "smollm2-135m"
PROMPT = "The history of the city begins in the"


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def windows(llm: LLM, tokens: int, seq_len: int) -> list[list[int]]:
    ids = llm.get_tokenizer()(WIKITEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    ids = ids[: (min(tokens, len(ids)) // seq_len) * seq_len]
    return [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]


def perplexity(llm: LLM, seqs: list[list[int]]) -> float:
    lps = token_logprobs(llm.engine, seqs)
    nll = -torch.cat(lps).double().mean().item()
    return float(torch.tensor(nll).exp())


def quantize(out: Path, **kw: Any) -> dict[str, float]:
    t, c = time.perf_counter(), cpu_seconds()
    quantize_model(QuantizeConfig(model=MODEL, output=out, overwrite=True, device="cpu", **kw))
    return {"quantize_wall_s": round(time.perf_counter() - t, 1), "quantize_cpu_s": round(cpu_seconds() - c, 1)}


def decode_tok_s(llm: LLM, n: int) -> float:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
    m = out.metrics
    return (len(out.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--decode-threads", type=int, default=1,
                    help="threads for the decode comparison: on a shared machine multi-threaded tiny kernels stall "
                         "(a 576x1536 int8/int4/bf16 GEMV: 0.03 ms on 1 thread, 16-24 ms on 2 busy ones)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/llmopt-quant-quality"))
    ap.add_argument("--json", type=Path, default=Path("quant_quality.json"))
    ap.add_argument("--calib", nargs="+", default=[str(GENERAL), str(KB)],
                    help="calibration sources (PATH or PATH:weight) for GPTQ, AWQ and the KV scales "
                         "(default: the general prose and the kb texts, mixed 1:1)")
    ap.add_argument("--extra-calib", type=Path, default=None,
                    help="also run W4A16 g64 GPTQ (act-order) and AWQ calibrated on this file, checked against the eval text")
    ap.add_argument("--only", nargs="*", default=None, help="run only these variants: whole labels select exactly those, otherwise by substring")
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    wd = args.work_dir
    wd.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"torch": torch.__version__, "threads": args.threads, "tokens": args.tokens,
                               "seq_len": args.seq_len, "calib": args.calib, "variants": {}}

    def save() -> None:
        args.json.write_text(json.dumps(results, indent=2))

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    calib = {"calib_data": args.calib, "num_samples": args.num_samples, "seq_len": args.calib_seq_len}
    kv = {"num_kv_blocks": 128}
    plan = [
        ("fp32", None, {}),
        ("W8A16 RTN", "w8a16", {"scheme": "w8a16"}),
        ("W4A16 g64 RTN", "w4a16-rtn", {"scheme": "w4a16", "group_size": 64}),
        ("W4A16 g64 GPTQ", "w4a16-gptq", {"scheme": "w4a16", "group_size": 64, "method": "gptq", "act_order": False,
                                          **calib}),
        ("W4A16 g64 GPTQ act-order", "w4a16-gptq-act", {"scheme": "w4a16", "group_size": 64, "method": "gptq",
                                                         "act_order": True, **calib}),
        ("W4A16 g64 GPTQ act-order dynamic-groups", "w4a16-gptq-act-dyn",
         {"scheme": "w4a16", "group_size": 64, "method": "gptq", "act_order": True, "static_groups": False,
          "format": "gptq", **calib}),
        ("W4A16 g64 GPTQ act-order mse", "w4a16-gptq-act-mse",
         {"scheme": "w4a16", "group_size": 64, "method": "gptq", "act_order": True, "mse": True, **calib}),
        ("W4A16 g64 AWQ", "w4a16-awq", {"scheme": "w4a16", "group_size": 64, "method": "awq", **calib}),
        ("W4A16 g64 RTN asym", "w4a16-rtn-asym", {"scheme": "w4a16", "group_size": 64, "symmetric": False}),
        ("W4A16 g32 RTN asym", "w4a16-g32-rtn-asym", {"scheme": "w4a16", "group_size": 32, "symmetric": False}),
        ("W4A16 g64 GPTQ act-order asym", "w4a16-gptq-act-asym",
         {"scheme": "w4a16", "group_size": 64, "method": "gptq", "act_order": True, "symmetric": False, **calib}),
        ("W4A16 g64 AWQ asym", "w4a16-awq-asym",
         {"scheme": "w4a16", "group_size": 64, "method": "awq", "symmetric": False, **calib}),
    ]
    if args.extra_calib is not None:
        extra = {"calib_data": [str(args.extra_calib)], "num_samples": args.num_samples,
                 "seq_len": args.calib_seq_len}
        plan.append((f"W4A16 g64 GPTQ act-order ({args.extra_calib.name})", "w4a16-gptq-extra",
                     {"scheme": "w4a16", "group_size": 64, "method": "gptq", "act_order": True, **extra}))
        plan.append((f"W4A16 g64 AWQ ({args.extra_calib.name})", "w4a16-awq-extra",
                     {"scheme": "w4a16", "group_size": 64, "method": "awq", **extra}))
    if args.only is not None:
        labels = {p[0] for p in plan}
        exact = all(o in labels for o in args.only)  # whole labels select exactly those variants
        plan = [p for p in plan if (p[0] in args.only if exact else any(o in p[0] for o in args.only))]
    seqs: list[list[int]] | None = None
    for label, sub, qopts in plan:
        entry: dict[str, Any] = {}
        source = MODEL
        if sub is not None:
            log(f"quantizing {label}")
            entry.update(quantize(wd / sub, **qopts))
            source = str(wd / sub)
        if not args.skip_ppl:
            llm = LLM(source, dtype="float32", device="cpu", **kv)
            seqs = seqs or windows(llm, args.tokens, args.seq_len)
            t = time.perf_counter()
            entry["ppl"] = perplexity(llm, seqs)
            entry["ppl_wall_s"] = round(time.perf_counter() - t, 1)
            log(f"{label}: ppl {entry['ppl']:.4f}")
            del llm
        results["variants"][label] = entry
        save()
    if not args.skip_ppl and (args.only is None or any("KV" in o for o in args.only)):
        log("calibrating KV-cache scales")
        run_calibration(CalibrateConfig(model=MODEL, data=args.calib, num_samples=args.num_samples,
                                        seq_len=args.calib_seq_len, output=wd / "calib", overwrite=True,
                                        device="cpu"))
        k, v = SavedStats.load(wd / "calib" / "stats.safetensors").kv_absmax(30)
        for label, static in (("INT8 KV (static calibrated per-head)", True), ("INT8 KV (dynamic per-token)", False)):
            llm = LLM(MODEL, dtype="float32", device="cpu", kv_cache_dtype="int8", **kv)
            if static:
                llm.engine.kv_cache.set_static_scales(k / 127.0, v / 127.0)
            results["variants"][label] = {"ppl": perplexity(llm, seqs or windows(llm, args.tokens, args.seq_len))}
            log(f"{label}: ppl {results['variants'][label]['ppl']:.4f}")
            del llm
            save()
    if not args.skip_decode:
        torch.set_num_threads(args.decode_threads)
        results["decode_threads"] = args.decode_threads
        engines = {"fp32": LLM(MODEL, dtype="float32", device="cpu", **kv),
                   "bf16 dense": LLM(MODEL, dtype="bfloat16", device="cpu", **kv),
                   "W8A16 (bf16 act.)": LLM(str(wd / "w8a16"), device="cpu", **kv),
                   "W4A16 g64 (bf16 act.)": LLM(str(wd / "w4a16-rtn"), device="cpu", **kv)}
        best: dict[str, float] = {}
        for llm in engines.values():
            decode_tok_s(llm, 8)  # warm-up
        for r in range(args.rounds):
            for name, llm in engines.items():
                best[name] = max(best.get(name, 0.0), decode_tok_s(llm, args.decode_tokens))
            log(f"decode round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in best.items()))
        results["decode_tok_s"] = {k: round(v, 2) for k, v in best.items()}
        save()
    print(render(results))


def render(results: dict[str, Any]) -> str:
    v = results["variants"]
    base = v.get("fp32", {}).get("ppl")
    rtn4 = v.get("W4A16 g64 RTN", {}).get("ppl")
    rtn4_asym = v.get("W4A16 g64 RTN asym", {}).get("ppl")
    lines = ["| variant | ppl | Δ vs fp32 | share of RTN-g64 Δ (same symmetry) | quantize wall / CPU s |", "|---|---|---|---|---|"]
    for label, e in v.items():
        ppl = e.get("ppl")
        d = f"{(ppl / base - 1) * 100:+.2f}%" if ppl and base else ""
        ref = rtn4_asym if "asym" in label else rtn4  # judged against RTN of the same symmetry
        share = f"{(ppl - base) / (ref - base):.2f}" if ppl and base and ref and ref > base and "W4" in label else ""
        q = f"{e['quantize_wall_s']} / {e['quantize_cpu_s']}" if "quantize_wall_s" in e else ""
        lines.append(f"| {label} | {ppl:.4f} | {d} | {share} | {q} |" if ppl else f"| {label} | | | | {q} |")
    if "decode_tok_s" in results:
        dec = results["decode_tok_s"]
        fp32 = dec.get("fp32")
        lines += ["", "| engine (1 stream, greedy) | decode tok/s | vs fp32 |", "|---|---|---|"]
        lines += [f"| {k} | {s:.1f} | {s / fp32:.2f}x |" for k, s in dec.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
