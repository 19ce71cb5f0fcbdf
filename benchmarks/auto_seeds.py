"""`--scheme auto` against uniform W4A16 g32 over several calibration draws: is auto's held-out perplexity lower
as a method, or only for one pair of checkpoints?

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/auto_seeds.py --model smollm2-135m --seeds 0,1,2,3,4
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/auto_seeds.py --model gemma3-270m --seeds 0,1,2,3

Issue #32's target puts `--scheme auto` at the bits of uniform W4A16 g32 below the best uniform 4-bit method by
held-out perplexity. One pair of 4-bit checkpoints of one size differs by more than the method: a change of
GPTQ's float arithmetic alone moved a point's perplexity by up to 7.6% (docs/QUANTIZE.md, session 37), and more
eval tokens do not average that away, because it is a property of the checkpoint, not of the text. So this script
draws the calibration windows with each of --seeds and quantizes both points from each draw, exactly as
benchmarks/quant_frontier.py quantizes them (its labels, helpers and scoring; seed 0 is the frontier's own draw):

* A (--auto): `auto 4.5 bits GPTQ|AWQ + int8 head` by default; B (--uniform): `W4A16 g32 GPTQ + int8 head`, the
  best uniform 4-bit point at that size on both models in the frontier. Both are 88.3-88.4 MB on SmolLM2.
* Each point is scored on the first --tokens tokens of both held-out texts in windows of 512 (our engine,
  float32): perplexity, KL to the unquantized model, and each window's mean NLL.
* Per seed: A's perplexity change over B with a paired BCa interval over windows (`llmopt eval --baseline`'s
  statistic). Over seeds: the mean of the seeds' log-ratios with a two-level bootstrap, seeds and windows both
  resampled, so the interval holds the calibration draw's spread as well as the text's; and Student's t over the
  seeds alone (with few seeds the bootstrap over them runs narrow).

Results go to runs/auto-seeds/<model>/seeds.json after each point (--reuse keeps finished ones), a Markdown
table to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from quant_frontier import (  # noqa: E402
    CALIB,
    SEQ,
    TEXTS,
    cpu_name,
    group_sizes,
    held_out_ids,
    log,
    our_points,
    quantize_ours,
    score,
)

RESAMPLES = 20000


def log_ratio(a: dict[str, Any], b: dict[str, Any], text: str) -> tuple[np.ndarray, np.ndarray]:
    """Per window: A's mean NLL minus B's, and the window's scored tokens."""
    tok = np.asarray(a["window_tokens"][text], dtype=np.float64)
    return np.asarray(a["window_nll"][text]) - np.asarray(b["window_nll"][text]), tok


def seed_interval(a: dict[str, Any], b: dict[str, Any], text: str) -> tuple[float, float, float]:
    """A's perplexity change over B in % with the paired BCa interval over windows: `llmopt eval --baseline`'s
    ppl_increase_pct (llmopt.eval.paired.window_estimate, B as the baseline)."""
    from llmopt.eval.paired import window_estimate
    from llmopt.eval.perplexity import TextScore

    est = window_estimate(TextScore({"seq_len": SEQ}, [], per_window_nll=[b["window_nll"][text], a["window_nll"][text]],
                                    window_tokens=a["window_tokens"][text]), "ppl_increase_pct")
    low, high = (est.low, est.high) if est and est.low is not None else (math.nan, math.nan)
    return (est.point if est else math.nan), low, high  # type: ignore[return-value]


def pooled_interval(ds: list[np.ndarray], tok: np.ndarray, confidence: float = 0.95, seed: int = 0
                    ) -> tuple[float, float, float]:
    """The mean over seeds of A's token-weighted log-ratio over B, as a % perplexity change, with a percentile
    interval from a two-level bootstrap: seeds resampled, and the windows (the same text for every seed)
    resampled jointly for all of them. scipy's bootstrap resamples one level; this needs both."""
    d = np.stack(ds)  # [seeds, windows]
    s, w = d.shape
    rng = np.random.default_rng(seed)
    cs = np.stack([np.bincount(rng.integers(0, s, s), minlength=s) for _ in range(RESAMPLES)])  # [R, seeds]
    cw = np.stack([np.bincount(rng.integers(0, w, w), minlength=w) for _ in range(RESAMPLES)])  # [R, windows]
    num = np.einsum("rs,sw,rw->r", cs, d * tok, cw)
    stat = 100.0 * np.expm1(num / (s * (cw @ tok)))
    point = 100.0 * math.expm1(float((d * tok).sum() / (s * tok.sum())))
    lo, hi = np.quantile(stat, [(1 - confidence) / 2, (1 + confidence) / 2])
    return point, float(lo), float(hi)


def seeds_t_interval(ds: list[np.ndarray], tok: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """Student's t interval over the seeds' log-ratios, as % perplexity changes: the calibration draw's spread
    alone, the text held fixed. With few seeds a bootstrap over them is too narrow; this one is not."""
    from scipy import stats

    x = np.array([float((d * tok).sum() / tok.sum()) for d in ds])
    lo, hi = stats.t.interval(confidence, len(x) - 1, loc=x.mean(), scale=stats.sem(x))
    return 100.0 * math.expm1(lo), 100.0 * math.expm1(hi)


def report(result: dict[str, Any], a: str, b: str) -> str:
    seeds = sorted(int(k) for k in result["seeds"] if {a, b} <= set(result["seeds"][k]))
    names = list(TEXTS)
    lines = [f"{result['model']}: `{a}` (A) against `{b}` (B), {result['tokens']} held-out tokens per text, "
             f"{result['num_samples']} x {SEQ} calibration windows per seed; {result['cpu']}, "
             f"{result['threads']} threads, torch {result['torch']}.", "",
             "| seed | " + " | ".join(f"{n} ppl A / B | A vs B, 95% | {n} KL A / B" for n in names) + " |",
             "|---|" + "---|---|---|" * len(names)]
    per_text: dict[str, list[np.ndarray]] = {n: [] for n in names}
    tok: dict[str, np.ndarray] = {}
    for sd in seeds:
        pa, pb = result["seeds"][str(sd)][a], result["seeds"][str(sd)][b]
        cells = []
        for n in names:
            d, tok[n] = log_ratio(pa, pb, n)
            per_text[n].append(d)
            pt, lo, hi = seed_interval(pa, pb, n)
            cells += [f"{pa['ppl'][n]:.3f} / {pb['ppl'][n]:.3f}", f"{pt:+.2f}% [{lo:+.2f}, {hi:+.2f}]",
                      f"{pa['kl'][n]:.4f} / {pb['kl'][n]:.4f}"]
        lines.append(f"| {sd} | " + " | ".join(cells) + " |")
    if len(seeds) >= 2:
        cells = []
        for n in names:
            pt, lo, hi = pooled_interval(per_text[n], tok[n])
            tlo, thi = seeds_t_interval(per_text[n], tok[n])
            ka = np.mean([result["seeds"][str(sd)][a]["kl"][n] for sd in seeds])
            kb = np.mean([result["seeds"][str(sd)][b]["kl"][n] for sd in seeds])
            lower = sum(float((d * tok[n]).sum()) < 0 for d in per_text[n])
            cells += [f"A lower in {lower} of {len(seeds)}", f"**{pt:+.2f}% [{lo:+.2f}, {hi:+.2f}]**; t over seeds [{tlo:+.2f}, {thi:+.2f}]",
                      f"{ka:.4f} / {kb:.4f} ({100 * (ka / kb - 1):+.0f}%)"]
        lines.append(f"| mean of {len(seeds)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="calibration draws (llmopt calibrate --seed)")
    ap.add_argument("--auto", default="auto 4.5 bits GPTQ|AWQ + int8 head", help="point A: a quant_frontier label")
    ap.add_argument("--uniform", default="", help="point B (default: W4A16 g<smallest> GPTQ + int8 head)")
    ap.add_argument("--tokens", type=int, default=8192, help="held-out tokens scored per text")
    ap.add_argument("--num-samples", type=int, default=16, help="calibration windows of 512 tokens per seed")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    ap.add_argument("--work", type=Path, default=ROOT / "runs/auto-seeds")
    ap.add_argument("--reuse", action="store_true", help="keep points already in the results file")
    args = ap.parse_args()

    import torch

    from llmopt.calibrate import CalibrateConfig, run_calibration
    from llmopt.eval.divergence import BaselineTopK
    from llmopt.io import write_text_atomic
    from llmopt.models.resolve import resolve_model, weights_dir
    from llmopt.models.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    model_dir = Path(weights_dir(resolve_model(args.model)))
    groups = group_sizes(model_dir)
    uniform = args.uniform or f"W4A16 g{min(groups)} GPTQ + int8 head"
    points = our_points(groups, [float(args.auto.split()[1])] if args.auto.startswith("auto") else [])
    unknown = [p for p in (args.auto, uniform) if p not in points]
    if unknown:
        raise SystemExit(f"error: {unknown[0]!r} is not a quant_frontier point of {args.model}")
    texts = held_out_ids(load_tokenizer(model_dir), args.tokens)
    work = args.work / args.model
    work.mkdir(parents=True, exist_ok=True)
    results_file = work / "seeds.json"
    result: dict[str, Any] = json.loads(results_file.read_text()) if args.reuse and results_file.is_file() else {}
    result |= {"model": args.model, "tokens": args.tokens, "num_samples": args.num_samples, "threads": args.threads,
               "torch": torch.__version__, "cpu": cpu_name()}
    result.setdefault("seeds", {})
    save = lambda: write_text_atomic(results_file, json.dumps(result))  # noqa: E731

    reference = {name: BaselineTopK() for name in texts}
    log("scoring the unquantized model (fp32), keeping its top-k log-probs for the points' KL")
    result["base"] = score(model_dir, texts, reference, record=True)
    save()
    for sd in seeds:
        done = result["seeds"].setdefault(str(sd), {})
        todo = [p for p in (args.auto, uniform) if p not in done]
        if not todo:
            continue
        calib = work / f"calib-{args.num_samples}x{SEQ}-seed{sd}"
        if not (calib / "stats.safetensors").is_file():
            log(f"seed {sd}: llmopt calibrate, {args.num_samples} x {SEQ} windows")
            run_calibration(CalibrateConfig(model=args.model, data=CALIB, num_samples=args.num_samples, seq_len=SEQ,
                                            seed=sd, output=calib, overwrite=True, device="cpu"))
        for label in todo:
            log(f"seed {sd}: {label}: quantizing")
            out = work / "ckpt"
            extra = quantize_ours(args.model, points[label], out, calib, {})
            log(f"seed {sd}: {label}: scoring")
            done[label] = {**score(out, texts, reference, windows=True), **extra}
            shutil.rmtree(out, ignore_errors=True)
            save()
            log(f"seed {sd}: {label}: ppl {done[label]['ppl']}, KL {done[label]['kl']}")
    print(report(result, args.auto, uniform))


if __name__ == "__main__":
    main()
