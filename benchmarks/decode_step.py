"""The native decode step (llmopt.step) against the eager one, side by side, and where a decode token goes.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/decode_step.py [--model smollm2-135m] [--schemes bf16,w8a16,w4a16]
        [--group-size 128] [--rounds 3] [--tokens 128] [--kv-cache-dtype auto|int8|fp8] [--batches 1,8]

For each scheme (bf16: the model as it is; w8a16 / w4a16: quantized first by RTN into a temporary folder, as
`llmopt quantize` writes them), two engines over the same checkpoint in one process, `decode_step="eager"`
(layer by layer, Python between the kernels) and `"native"` (one call per step), both bf16 and packed as
`llmopt serve` loads them. Rounds alternate (A B, B A, ...): greedy decode of --tokens tokens after a 32-token
prompt, one sequence and a batch of 8 (`--batches`; past 64, both engines' max_num_seqs is raised to the largest).
Reported: median tok/s of each, their ratio and whether greedy tokens agree. Then one profiled single-stream run
of the native engine: per token, the time inside the step by kind of op (clock reads around each op), the
lm_head (timed around `compute_logits`) and the rest (scheduling, embedding, RoPE tables, attention metadata,
sampling, detokenizing). Absolute numbers on a shared machine are noise; the ratios, measured side by side, are
the result.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

PROMPT = list(range(100, 132))  # 32 token ids, the same for every engine and checkpoint compared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--schemes", default="bf16,w8a16,w4a16")
    ap.add_argument("--group-size", type=int, default=64, help="of w4a16 (64 divides every width of the default model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8"), help="of both engines")
    ap.add_argument("--batches", default="1,8", help="sequences decoded at once, per measurement (1 is profiled)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    import torch

    from llmopt import LLM, SamplingParams
    from llmopt.quant.pipeline import quantize_model
    from llmopt.quant.recipe import QuantizeConfig

    work = Path(tempfile.mkdtemp(prefix="decode-step-"))
    prompt = PROMPT
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    rows = []
    try:
        for scheme in args.schemes.split(","):
            path = args.model
            if scheme != "bf16":
                path = str(work / scheme)
                quantize_model(QuantizeConfig(model=args.model, scheme=scheme, output=path, device="cpu",
                                              group_size=args.group_size if scheme == "w4a16" else None))
            llms = {mode: LLM(path, dtype="bfloat16", decode_step=mode, kv_cache_dtype=args.kv_cache_dtype,
                              max_num_seqs=max(64, *batches))
                    for mode in ("eager", "native")}
            assert llms["native"].engine.runner.decode_step is not None, "the native step did not build"
            for llm in llms.values():
                llm.generate([prompt], params)  # warm-up: kernel builds, first-call costs
            speed: dict[tuple[str, int], list[float]] = {}
            tokens: dict[tuple[str, int], list[list[int]]] = {}
            for rnd in range(args.rounds):
                for mode in ("eager", "native") if rnd % 2 == 0 else ("native", "eager"):
                    for batch in batches:
                        t = time.perf_counter()
                        outs = llms[mode].generate([prompt] * batch, params, use_tqdm=False)
                        speed.setdefault((mode, batch), []).append(batch * args.tokens / (time.perf_counter() - t))
                        tokens[(mode, batch)] = [list(o.outputs[0].token_ids) for o in outs]
            profile = profile_single_stream(llms["native"], prompt, params, args.tokens) if 1 in batches else None
            for batch in batches:
                e, n = (statistics.median(speed[(m, batch)]) for m in ("eager", "native"))
                rows.append((scheme, batch, e, n, tokens[("eager", batch)] == tokens[("native", batch)],
                             profile if batch == 1 else None))
            del llms
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.model}, bf16 activations, KV cache {args.kv_cache_dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.tokens} tokens after a 32-token prompt, median of {args.rounds} rounds\n")
    print("| scheme | sequences | eager tok/s | native tok/s | native / eager | greedy tokens equal |")
    print("|---|---|---|---|---|---|")
    for scheme, batch, e, n, same, _ in rows:
        print(f"| {scheme} | {batch} | {e:.1f} | {n:.1f} | {n / e:.2f}x | {'yes' if same else 'NO'} |")
    print("\nWhere a single-stream token goes with the native step (ms per token):\n")
    kinds = ["linear", "attend", "norm", "rotary", "act", "kv_write", "head_norm", "gather_cols"]
    print("| scheme | total | " + " | ".join(kinds) + " | lm_head | outside the step and head |")
    print("|---|---|" + "---|" * len(kinds) + "---|---|")
    for scheme, _, _, _, _, prof in rows:
        if prof is not None:
            total, ops, head = prof
            rest = total - sum(ops.values()) - head
            print(f"| {scheme} | {total:.2f} | " + " | ".join(f"{ops[k]:.2f}" for k in kinds)
                  + f" | {head:.2f} | {rest:.2f} |")


def profile_single_stream(llm, prompt, params, n_tokens: int):
    """(ms per token in all, ms per token per op kind inside the step, ms per token in the head) of one
    single-stream generation (its prefill counted in the total: one step of n_tokens)."""
    runner = llm.engine.runner
    model = runner.model
    step = runner.decode_step
    head_seconds = [0.0]
    real = model.compute_logits

    def timed(hidden):
        t = time.perf_counter()
        out = real(hidden)
        head_seconds[0] += time.perf_counter() - t
        return out

    model.compute_logits = timed
    step.start_profile()
    t = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    total = time.perf_counter() - t
    del model.compute_logits
    ops = {k: 1000 * v / n_tokens for k, v in step.op_seconds().items()}
    step.stop_profile()
    return 1000 * total / n_tokens, ops, 1000 * head_seconds[0] / n_tokens


if __name__ == "__main__":
    main()
