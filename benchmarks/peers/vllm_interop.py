"""Do our checkpoints run in vLLM, and do they mean there what they mean in llmopt?

For each scheme: quantize the model with `llmopt quantize` (library call), then load the checkpoint in
llmopt's engine and in vLLM (its own venv, `benchmarks/peers/install_vllm.sh`) at the same dtype, and
compare greedy tokens on a few prompts and perplexity on the same token windows. A scheme vLLM cannot
load is a row with vLLM's own one-line reason. Not part of `make test`: vLLM is a multi-GB install.

    make interop                     # = python benchmarks/peers/vllm_interop.py
    python benchmarks/peers/vllm_interop.py --schemes w4a16,w8a8 --tokens 4096 --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# name -> `llmopt quantize` options (None: the unquantized model, vLLM's own baseline)
SCHEMES: dict[str, dict | None] = {
    "bf16": None,
    "w8a16": {"scheme": "w8a16"},
    "w4a16": {"scheme": "w4a16", "group_size": 64},
    "w4a16-gptq": {"scheme": "w4a16", "group_size": 64, "method": "gptq", "format": "gptq"},
    # the default: GPTQ (act-order, static groups) in compressed-tensors, which declares actorder "weight"
    "w4a16-gptq-ct": {"scheme": "w4a16", "group_size": 64, "method": "gptq"},
    "fp8": {"scheme": "fp8"},
    "w8a8": {"scheme": "w8a8"},
    "w8a16-kv-int8": {"scheme": "w8a16", "kv_cache": "int8"},
    # int4 weights: vLLM CPU has no kernel for int8 weight-only linears (uint8b128), so these rows use W4A16
    "w4a16-kv-fp8": {"scheme": "w4a16", "group_size": 64, "kv_cache": "fp8"},
    # the same with one scale per KV head (compressed-tensors' "attn_head"; vLLM CPU takes each layer's largest)
    "w4a16-kv-fp8-head": {"scheme": "w4a16", "group_size": 64, "kv_cache": "fp8", "kv_cache_strategy": "attn_head"},
    # a mixed checkpoint: each linear int4 in groups of 128, 64 or 32, or left bf16, chosen by --scheme auto
    # under 5 bits/weight (one config group per group size, the float linears in `ignore`)
    "auto-mixed": {"scheme": "auto", "target_bits": 5.0, "candidates": ["w4a16-g128", "w4a16-g64", "w4a16-g32",
                                                                        "bf16"]},
}
# what vLLM must be told besides the checkpoint: it reads the fp8 kv_cache_scheme's k/v scales only for an fp8 cache
VLLM_ARGS: dict[str, dict] = {name: {"kv_cache_dtype": "fp8"} for name, opts in SCHEMES.items()
                              if opts and opts.get("kv_cache") == "fp8"}
CALIB = ["calibration_data/general_prose.jsonl", "calibration_data/kb_calibration.jsonl"]
PROMPTS = ["The capital of France is", "A KV cache stores", "def fibonacci(n):\n",
           "The three primary colours are"]


def _text(path: str | None) -> str:
    candidates = [Path(path)] if path else [ROOT.parent / "shared/data/wikitext2-valid.txt",
                                            ROOT / "calibration_data/kb_facts.md"]
    for p in candidates:
        if p.is_file():
            return p.read_text()
    raise SystemExit(f"error: no text to score ({', '.join(map(str, candidates))} missing)")


def _checkpoint(model: str, name: str, opts: dict | None, out: Path) -> str:
    if opts is None:
        from llmopt.models.resolve import resolve_model, weights_dir

        return str(weights_dir(resolve_model(model)))
    from llmopt.quant.pipeline import quantize_model
    from llmopt.quant.recipe import QuantizeConfig

    path = out / name
    if not (path / "config.json").is_file():
        needs = opts.get("method") in ("gptq", "awq") or opts["scheme"] in ("w8a8", "auto") or opts.get("kv_cache")
        quantize_model(QuantizeConfig(model=model, output=path, device="cpu", calib_data=CALIB if needs else [],
                                      num_samples=64, seq_len=512, **opts))
    return str(path)


def _ours(path: str, dtype: str, prompts: list[list[int]], max_tokens: int,
          windows: list[list[int]]) -> dict:
    from llmopt.engine.llm import LLM
    from llmopt.engine.sampling_params import SamplingParams
    from llmopt.engine.scoring import token_logprobs

    llm = LLM(path, dtype=dtype, device="cpu", kv_cache_memory="512MiB")
    outs = llm.generate([list(p) for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                   ignore_eos=True))
    lps = token_logprobs(llm.engine, windows)
    nll = -sum(float(lp.double().sum()) for lp in lps)
    tokens = sum(len(lp) for lp in lps)
    return {"greedy": [list(o.outputs[0].token_ids) for o in outs], "ppl": math.exp(nll / tokens)}


def _vllm(name: str, python: str, path: str, dtype: str, prompts, max_tokens: int, windows, work: Path,
          threads: int, extra_env: dict[str, str]) -> dict:
    job = work / f"{name}.job.json"
    job.write_text(json.dumps({"model": path, "dtype": dtype, "max_model_len": max(map(len, windows)) + 8,
                               "prompts": prompts, "max_tokens": max_tokens, "windows": windows,
                               "llm_args": VLLM_ARGS.get(name, {})}))
    result = work / f"{name}.vllm.json"
    result.unlink(missing_ok=True)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": str(threads),
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_LOGGING_LEVEL": "WARNING",
           **extra_env}
    env.pop("LLMOPT_CACHE", None)
    log = work / f"{name}.vllm.log"
    with log.open("w") as f:
        subprocess.run([python, str(ROOT / "benchmarks/peers/vllm_worker.py"), str(job), str(result)], env=env,
                       stdout=f, stderr=subprocess.STDOUT, timeout=1800, check=False)
    if not result.is_file():
        return {"ok": False, "error": f"vLLM worker died: {_root_cause(log) or 'no output'}"}
    res = json.loads(result.read_text())
    if not res["ok"]:
        res["error"] = _root_cause(log) or res["error"]
    return res


def _root_cause(log: Path) -> str | None:
    """The first exception line in vLLM's log: the engine core's own error, not the wrappers after it."""
    lines = log.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"\b([A-Za-z_.]*(?:Error|Exception)): (.+)$", line)
        if m and "Engine core initialization failed" not in line:
            text = m.group(2).strip()
            if text.endswith(":"):  # "Reasons:" and the reasons on the lines below, up to a blank one
                more = []
                for x in lines[i + 1:i + 6]:
                    x = re.sub(r"^.*?\] ", "", x).strip()
                    if not x or x.startswith("Traceback") or "failed to start" in x:
                        break
                    more.append(x)
                text += " " + ("; ".join(more) or "(none listed)")
            return f"{m.group(1)}: {text}"[:600]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--text", default=None, help="text to score (default ../shared/data/wikitext2-valid.txt)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the text scored")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--vllm-python", default=str(ROOT / ".peers/vllm/bin/python"))
    ap.add_argument("--out", default=str(ROOT / "runs/interop"))
    ap.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for vLLM, repeatable (default VLLM_CPU_INT4_W4A8=0: vLLM CPU otherwise runs "
                         "int4 weights with int8 activations on AMX CPUs, which is not the W4A16 scheme)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    extra_env = {"VLLM_CPU_INT4_W4A8": "0"} | dict(kv.split("=", 1) for kv in args.vllm_env)
    names = [s.strip() for s in args.schemes.split(",") if s.strip()]
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        raise SystemExit(f"error: unknown scheme(s) {', '.join(unknown)}; choose from {', '.join(SCHEMES)}")
    if not Path(args.vllm_python).is_file():
        raise SystemExit(f"error: {args.vllm_python} missing: run benchmarks/peers/install_vllm.sh first")

    import torch

    from llmopt.models.resolve import resolve_model, weights_dir
    from llmopt.models.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(weights_dir(resolve_model(args.model)))
    ids = tok.encode(_text(args.text), add_special_tokens=False)[: args.tokens]
    windows = [ids[i:i + args.seq_len] for i in range(0, len(ids) - 1, args.seq_len) if len(ids[i:i + args.seq_len]) > 1]
    prompts = [tok.encode(p) for p in PROMPTS]
    versions = json.loads(subprocess.run(
        [args.vllm_python, "-c", "import json, vllm, torch, transformers, compressed_tensors as ct; print(json.dumps("
         "{'vllm': vllm.__version__, 'torch': torch.__version__, 'transformers': transformers.__version__, "
         "'compressed-tensors': ct.__version__}))"], capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    rows = []
    for name in names:
        t0 = time.perf_counter()
        path = _checkpoint(args.model, name, SCHEMES[name], out)
        ours = _ours(path, args.dtype, prompts, args.max_tokens, windows)
        theirs = _vllm(name, args.vllm_python, path, args.dtype, prompts, args.max_tokens, windows, out, args.threads, extra_env)
        row = {"scheme": name, "checkpoint": path, "llmopt_ppl": ours["ppl"], "vllm_loads": theirs["ok"]}
        if theirs["ok"]:
            same = sum(a == b for a, b in zip(ours["greedy"], theirs["greedy"], strict=True))
            prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
                      for a, b in zip(ours["greedy"], theirs["greedy"], strict=True)]
            row |= {"vllm_ppl": theirs["ppl"], "ppl_diff_pct": 100 * (theirs["ppl"] / ours["ppl"] - 1),
                    "greedy_equal": f"{same}/{len(prompts)}", "greedy_common_prefix": prefix}
        else:
            row["vllm_error"] = theirs["error"]
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    report = {"versions": versions, "vllm_env": extra_env, "model": args.model, "dtype": args.dtype, "tokens": len(ids),
              "seq_len": args.seq_len, "threads": args.threads, "rows": rows}
    (out / "interop.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"vLLM {versions['vllm']} (torch {versions['torch']}, transformers {versions['transformers']}, "
          f"compressed-tensors {versions['compressed-tensors']}), {args.dtype}, {len(ids)} tokens in "
          f"{len(windows)} windows of {args.seq_len}, greedy {args.max_tokens} tokens x {len(prompts)} prompts, "
          f"{args.threads} threads, vLLM env {extra_env}\n")
    print("| scheme | llmopt ppl | vLLM CPU | vLLM ppl | ppl diff | greedy equal (common prefix) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["vllm_loads"]:
            print(f"| {r['scheme']} | {r['llmopt_ppl']:.3f} | loads | {r['vllm_ppl']:.3f} | {r['ppl_diff_pct']:+.2f}% | "
                  f"{r['greedy_equal']} ({', '.join(map(str, r['greedy_common_prefix']))}) |")
        else:
            print(f"| {r['scheme']} | {r['llmopt_ppl']:.3f} | **fails**: {r['vllm_error']} | | | |")


if __name__ == "__main__":
    main()
