"""Mixed W4/W8: the cheapest `--override` list that keeps SmolLM2's perplexity increase within a gate.

    python benchmarks/mixed_precision.py [--gate-pct 5] [--proxy-tokens 4096] [--tokens 32768] [--json F]

1. Sensitivity, on a short proxy text (the first --proxy-tokens tokens of WikiText-2 validation): start
   from every linear at W8A16 (per channel), put one unit at a time (a layer's attention q|k|v + o, or
   its MLP gate|up + down) at W4A16 (RTN, symmetric, group 64) and score perplexity. Weights are
   swapped in place in one fp32 engine, so each unit costs one scoring pass.
2. Greedy: take units in order of increasing damage and find, by bisection, the longest prefix whose
   joint perplexity stays within --gate-pct of fp32 on the scored text itself (the first --tokens
   tokens; a 4k-token proxy said +4.8% for a set that scored +6.4% on 32k tokens).
3. Confirm with the real thing: `llmopt quantize --scheme w8a16 --override REGEX=w4a16 ...` for the
   chosen units, scored on the first --tokens tokens (the protocol of benchmarks/quant_quality.py),
   with the checkpoint's weight bytes against pure W8A16.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from llmopt import LLM
from llmopt.engine.scoring import token_logprobs
from llmopt.quant.pipeline import quantize_model
from llmopt.quant.recipe import QuantizeConfig
from llmopt.quant.rtn import rtn_fake_quantize
from llmopt.quant.scheme import QuantScheme

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext2-valid.txt"
MODEL = "smollm2-135m"
W8 = QuantScheme(bits=8, group_size=-1, symmetric=True)
W4 = QuantScheme(bits=4, group_size=64, symmetric=True)
UNITS = {"attn": ("self_attn.qkv_proj", "self_attn.o_proj"), "mlp": ("mlp.gate_up_proj", "mlp.down_proj")}
HF_REGEX = {"attn": r"layers\.{i}\.self_attn\.", "mlp": r"layers\.{i}\.mlp\."}


def windows(llm: LLM, tokens: int, seq_len: int = 512) -> list[list[int]]:
    ids = llm.get_tokenizer()(WIKITEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    ids = ids[: (min(tokens, len(ids)) // seq_len) * seq_len]
    return [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]


def perplexity(llm: LLM, seqs: list[list[int]]) -> float:
    nll = -torch.cat(token_logprobs(llm.engine, seqs)).double().mean().item()
    return float(torch.tensor(nll).exp())


def weight_bytes(out_dir: Path) -> int:
    """Bytes of the decoder's quantized linears in the checkpoint (embeddings and norms excluded)."""
    from safetensors import safe_open

    total = 0
    for f in out_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if ".layers." in k and "norm" not in k:
                    t = st.get_slice(k)
                    n = 1
                    for d in t.get_shape():
                        n *= d
                    total += n * {"I64": 8, "I32": 4, "I16": 2, "F16": 2, "BF16": 2, "F32": 4, "I8": 1, "U8": 1,
                                  "F8_E4M3": 1}[t.get_dtype()]
    return total


def search(args) -> dict:
    """Steps 1-2 (module doc): per-unit damage on the proxy, then the longest safe prefix."""
    llm = LLM(MODEL, dtype="float32", device="cpu", num_kv_blocks=128)
    model = llm.engine.model
    proxy = windows(llm, args.proxy_tokens)
    originals = {}
    for i, layer in enumerate(model.layers):
        for names in UNITS.values():
            for n in names:
                lin = layer.get_submodule(n)
                originals[(i, n)] = lin.weight.data.clone()
                lin.weight.data = rtn_fake_quantize(lin.weight.data, W8).to(lin.weight.dtype)

    def set_unit(i: int, kind: str, scheme: QuantScheme) -> None:
        for n in UNITS[kind]:
            lin = model.layers[i].get_submodule(n)
            lin.weight.data = rtn_fake_quantize(originals[(i, n)], scheme).to(lin.weight.dtype)

    base = perplexity(llm, proxy)
    print(f"all W8A16 on the proxy: ppl {base:.4f}", flush=True)
    if args.ranking is not None:
        damage = [tuple(d) for d in json.loads(args.ranking.read_text())["damage"]]
    else:
        damage = []
        for i in range(len(model.layers)):
            for kind in UNITS:
                set_unit(i, kind, W4)
                ppl = perplexity(llm, proxy)
                set_unit(i, kind, W8)
                damage.append((ppl / base - 1, i, kind))
                print(f"layer {i:2d} {kind:4s} at W4: {100 * (ppl / base - 1):+.2f}%", flush=True)
    damage.sort()
    scored = windows(llm, args.tokens)
    for (i, n), w in originals.items():  # fp32 reference on the scored text
        model.layers[i].get_submodule(n).weight.data = w.clone()
    fp32 = perplexity(llm, scored)
    for i in range(len(model.layers)):
        for kind in UNITS:
            set_unit(i, kind, W8)

    def joint(n: int) -> float:
        for _, i, kind in damage[:n]:
            set_unit(i, kind, W4)
        ppl = perplexity(llm, scored)
        for _, i, kind in damage[:n]:
            set_unit(i, kind, W8)
        return ppl / fp32 - 1

    lo, hi = 0, len(damage)  # invariant: joint(lo) within the gate
    while lo < hi:
        mid = (lo + hi + 1) // 2
        inc = joint(mid)
        print(f"{mid} units at W4: {100 * inc:+.2f}% vs fp32 on {args.tokens} tokens", flush=True)
        if inc <= args.gate_pct / 100:
            lo = mid
        else:
            hi = mid - 1
    chosen = damage[:lo]
    overrides = [HF_REGEX[kind].format(i=i) + "=w4a16" for _, i, kind in chosen]
    print(f"chosen: {lo} of {len(damage)} units at W4A16", flush=True)

    return {"gate_pct": args.gate_pct, "proxy_tokens": args.proxy_tokens, "tokens": args.tokens,
            "proxy_all_w8_ppl": base, "damage": [(d, i, k) for d, i, k in damage], "overrides": overrides}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gate-pct", type=float, default=5.0)
    ap.add_argument("--proxy-tokens", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/llmopt-mixed-precision"))
    ap.add_argument("--json", type=Path, default=Path("mixed_precision.json"))
    ap.add_argument("--ranking", type=Path, default=None,
                    help="skip step 1: reuse the per-unit damage ranking of an earlier --json")
    ap.add_argument("--confirm-only", type=Path, default=None,
                    help="skip steps 1-2: take the overrides from this earlier --json (written after step 2)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    if args.confirm_only is not None:
        results = json.loads(args.confirm_only.read_text())
    else:
        results = search(args)
        args.json.write_text(json.dumps(results, indent=2))
    overrides = results["overrides"]
    # confirm with real checkpoints, scored like benchmarks/quant_quality.py
    wd = args.work_dir
    for name, extra in (("w8a16", []), ("mixed", overrides)):
        out = wd / name
        quantize_model(QuantizeConfig(model=MODEL, scheme="w8a16", override=extra, output=out, overwrite=True,
                                      device="cpu"))
        q = LLM(str(out), dtype="float32", device="cpu", num_kv_blocks=128)
        results[name] = {"ppl": perplexity(q, windows(q, args.tokens)), "weight_bytes": weight_bytes(out)}
        print(name, results[name], flush=True)
        del q
    fp32 = LLM(MODEL, dtype="float32", device="cpu", num_kv_blocks=128)
    results["fp32_ppl"] = perplexity(fp32, windows(fp32, args.tokens))
    results["mixed"]["increase_pct"] = 100 * (results["mixed"]["ppl"] / results["fp32_ppl"] - 1)
    results["w8a16"]["increase_pct"] = 100 * (results["w8a16"]["ppl"] / results["fp32_ppl"] - 1)
    results["bytes_saved_vs_w8a16_pct"] = 100 * (1 - results["mixed"]["weight_bytes"] / results["w8a16"]["weight_bytes"])
    results["wall_s"] = round(time.perf_counter() - t_start, 1)
    args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "damage"}, indent=2))


if __name__ == "__main__":
    main()
