"""Perplexity against temperature: how much of a checkpoint's held-out perplexity is the confidence of its
predictions rather than damage to them.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/ppl_temperature.py --model gemma3-270m \\
        fp32=gemma3-270m ours=runs/x/ckpt theirs=runs/y/ckpt [--tokens 8192] [--json out.json]

For each LABEL=MODEL (a name `llmopt` resolves, or a checkpoint folder): perplexity with the logits divided
by each temperature T of --temperatures, the T that scores lowest and its perplexity, and the mean entropy of
the predictions at T = 1, on the texts and windows benchmarks/quant_frontier.py scores (the first --tokens tokens
of wikitext2-valid.txt and tinyshakespeare.txt, non-overlapping windows of 512, our engine in float32, the text
tokenized once by --model's tokenizer). A model whose perplexity falls well below its T = 1 value at some T > 1
is over-confident on that text: there, any change that flattens its predictions lowers perplexity without
bringing its outputs closer to the original's (docs/QUANTIZE.md, "Gemma 3's perplexity and its temperature").
The best T is chosen on the scored text itself, so it is a diagnostic, not a held-out score.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_frontier import SEQ, held_out_ids  # noqa: E402  benchmarks/: the frontier's texts and window length

TEMPERATURES = "0.8,0.9,1.0,1.05,1.1,1.15,1.2,1.3,1.4,1.6"


def scan(path: str, texts: dict[str, list[int]], temps: list[float]) -> dict[str, dict]:
    """Per text: perplexity at each temperature (1.0 among them), the best one, and the mean entropy (nats) at
    T = 1."""
    import torch

    from llmopt import LLM
    from llmopt.engine.scoring import iter_hidden
    from llmopt.eval.perplexity import make_windows

    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=64)
    engine, out = llm.engine, {}
    with torch.no_grad():
        for name, ids in texts.items():
            windows = make_windows(len(ids), SEQ)
            nll, entropy, n = torch.zeros(len(temps), dtype=torch.float64), 0.0, 0
            targets = torch.tensor(ids)
            for j, hidden in iter_hidden(engine, [ids[w.begin:w.end] for w in windows], max_batch_tokens=2048):
                w = windows[j]
                for lo in range(w.score_from - 1, w.length - 1, 64):
                    hi = min(lo + 64, w.length - 1)
                    logits = engine.model.compute_logits(hidden[lo:hi]).float()
                    tgt = targets[w.begin + lo + 1:w.begin + hi + 1, None]
                    for i, t in enumerate(temps):
                        lp = torch.log_softmax(logits / t, -1)
                        nll[i] -= lp.gather(1, tgt).double().sum()
                        if t == 1.0:
                            entropy -= float((lp.exp() * lp).sum(-1).double().sum())
                    n += hi - lo
            ppl = torch.exp(nll / n).tolist()
            best = min(range(len(temps)), key=ppl.__getitem__)
            out[name] = {"ppl": dict(zip(map(str, temps), ppl, strict=True)), "best_t": temps[best],
                         "best_ppl": ppl[best], "entropy": entropy / n, "tokens": n}
    del llm, engine
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", metavar="LABEL=MODEL")
    ap.add_argument("--model", required=True, help="whose tokenizer tokenizes the texts (name or folder)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--temperatures", default=TEMPERATURES)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    pairs = [m.split("=", 1) for m in args.models]
    if any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
        raise SystemExit("error: give each model as LABEL=MODEL")
    try:
        temps = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        temps = []
    if 1.0 not in temps or any(t <= 0 for t in temps):
        raise SystemExit("error: --temperatures must be positive numbers, comma-separated, and include 1.0")

    import torch

    from llmopt.models.resolve import resolve_model, weights_dir
    from llmopt.models.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    source = Path(args.model)
    tok = load_tokenizer(source if source.is_dir() else Path(weights_dir(resolve_model(args.model))))
    texts = held_out_ids(tok, args.tokens)
    results = {}
    print("| model | text | ppl at T=1 | best T | ppl at best T | entropy at T=1 (nats) |\n|---|---|---|---|---|---|")
    for label, model in pairs:
        results[label] = scan(model, texts, temps)
        for name, r in results[label].items():
            print(f"| {label.replace('|', chr(92) + '|')} | {name} | {r['ppl']['1.0']:.3f} | {r['best_t']:g} | {r['best_ppl']:.3f} | "
                  f"{r['entropy']:.3f} |", flush=True)
    if args.json:
        from llmopt.io import write_text_atomic

        write_text_atomic(args.json, json.dumps({"tokens": args.tokens, "temperatures": temps,
                                                 "results": results}, indent=1))


if __name__ == "__main__":
    main()
