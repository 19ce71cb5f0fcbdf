"""`quantize --lm-head int8|int4`: decode speed and perplexity against the same checkpoint with its float (bf16)
head.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/quantized_head.py [--model gemma3-270m] [--scheme w8a16]
        [--group-size N] [--heads int8,int4] [--tokens 4096] [--rounds 3]

Checkpoints quantized alike (RTN, --scheme/--group-size), one with the float head and one per `--heads` entry:
the head, and the embedding a tied head shares, as int8 with a scale per row or int4 with a scale per 32
columns, which our engine runs with its int8 / int4 kernels. All are loaded once in one process, as `llmopt
serve` would (bf16, packed); then rounds alternate between them
(A B, B A, ...): greedy decode of 128 tokens after a 32-token prompt, one sequence and a batch of 8. Reported:
median tok/s of each, their ratio, and whether greedy tokens agree; perplexity of each on the first --tokens
tokens of ../shared/data/wikitext2-valid.txt in windows of 512 (bf16, the engine's default), and the head's
bytes. Absolute numbers on a shared machine are noise; the ratios, measured side by side, are the result.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared/data/wikitext2-valid.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--scheme", default="w8a16")
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", default="int8", help="comma-separated --lm-head values to compare with the float head")
    args = ap.parse_args()

    import torch

    from llmopt import LLM, SamplingParams
    from llmopt.eval.perplexity import score_text
    from llmopt.quant.pipeline import quantize_model
    from llmopt.quant.recipe import QuantizeConfig

    work = Path(tempfile.mkdtemp(prefix="quantized-head-"))
    try:
        llms, head_bytes = {}, {}
        heads = [("float head", None)] + [(f"{h} head", h) for h in args.heads.split(",")]
        for name, head in heads:
            report = quantize_model(QuantizeConfig(model=args.model, scheme=args.scheme, group_size=args.group_size,
                                                   lm_head=head, output=work / name, device="cpu"))
            head_bytes[name] = report.head["bytes"] if report.head else None
            llms[name] = LLM(str(work / name), dtype="bfloat16")
        prompt = list(range(100, 132))
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        speed: dict[tuple[str, int], list[float]] = {}
        tokens: dict[tuple[str, int], list[list[int]]] = {}
        for llm in llms.values():
            llm.generate([prompt], params)  # warm-up: kernel builds, first-call costs
        names = list(llms)
        for rnd in range(args.rounds):
            for name in names if rnd % 2 == 0 else names[::-1]:
                for batch in (1, 8):
                    t = time.perf_counter()
                    outs = llms[name].generate([prompt] * batch, params)
                    speed.setdefault((name, batch), []).append(batch * 128 / (time.perf_counter() - t))
                    tokens[(name, batch)] = [list(o.outputs[0].token_ids) for o in outs]
        text = WIKITEXT.read_text(encoding="utf-8") if WIKITEXT.is_file() else None
        ppl = {}
        for name, llm in llms.items():
            if text is not None:
                ids = llm.engine.tokenizer.encode(text)[: args.tokens]
                ppl[name] = score_text(llm.engine, ids, 512).nll[0].ppl
        print(f"{args.model}, {args.scheme}{f' g{args.group_size}' if args.group_size else ''} RTN, bf16, "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
        print("| head | sequences | tok/s (median) | vs float head | greedy tokens equal to float head's | "
              "wikitext-2 ppl | head bytes |")
        print("|---|---|---|---|---|---|---|")
        for batch in (1, 8):
            base = statistics.median(speed[("float head", batch)])
            for name in names:
                v = statistics.median(speed[(name, batch)])
                same = sum(a == b for a, b in zip(tokens[(name, batch)], tokens[("float head", batch)], strict=True))
                p = f"{ppl[name]:.3f}" if name in ppl else ""
                hb = f"{head_bytes[name] / 1e6:.1f} MB" if head_bytes[name] else "bf16"
                rounds = ", ".join(f"{x:.1f}" for x in speed[(name, batch)])
                print(f"| {name} | {batch} | {v:.1f} ({rounds}) | {v / base:.2f}× | {same}/{batch} | {p} | {hb} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
