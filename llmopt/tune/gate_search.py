"""`quantize --scheme auto --gate EXPR --eval-data PATH`: the smallest checkpoint that passes an eval gate.

The precision search (`llmopt.quant.auto`) measures every linear's candidates once; then budgets are
tried by bisection, each one quantized for real from those measurements and scored by `llmopt eval`
against the source model on the held-out text, with the gates (the source model is scored once, by the
first trial, and its scores reused: `BaselineCache`). The bits between the cheapest choice
everywhere and the dearest quantized one everywhere are halved until a passing and a failing budget lie
within `TOLERANCE_BITS` of each other; the passing one is the output. Gates are checked, and the eval
text read, before any quantization, and if even the dearest budget fails nothing is written (exit 1).

Bisection assumes quality improves with the budget: the allocation is monotone in predicted damage, and
each trial's measured result is in the report, so a user sees where that assumption bent.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

import llmopt.quant.pipeline as pipeline  # called through the module, so tests can stand in for it
from llmopt.devices import torch_threads
from llmopt.errors import GateFailed
from llmopt.eval.compare import BaselineCache, check_inputs, run_eval
from llmopt.eval.options import EvalOptions
from llmopt.io import atomic_directory, check_output_dir
from llmopt.quant.auto import AutoPlan
from llmopt.quant.pipeline import REPORT, auto_bounds
from llmopt.quant.recipe import QuantizeConfig
from llmopt.quant.report import QuantReport

TOLERANCE_BITS = 0.25  # stop once a passing and a failing budget are this close


def quantize(cfg: QuantizeConfig, console: Console | None = None) -> QuantReport:
    """`llmopt quantize`: with `--gate`, the gate search; otherwise one quantization (`quantize_model`)."""
    if cfg.gate:
        with torch_threads(cfg.threads):  # the evals too
            return quantize_to_gate(cfg, console)
    return pipeline.quantize_model(cfg, console)


def _eval_options(cfg: QuantizeConfig, candidate: str | None) -> EvalOptions:
    return EvalOptions(model=candidate, baseline=cfg.model or "smollm2-135m", ppl_data=cfg.eval_data,
                       seq_len=cfg.eval_seq_len, max_tokens=cfg.eval_max_tokens, gates=cfg.gate,
                       device=cfg.device)


def quantize_to_gate(cfg: QuantizeConfig, console: Console | None = None) -> QuantReport:
    """The module doc's bisection; returns the report of the checkpoint written to `cfg.output`. Raises
    GateFailed (exit 1) when no budget passes."""
    console = console or Console(stderr=True)
    check_output_dir(cfg.output, cfg.overwrite)
    check_inputs(_eval_options(cfg, None))  # the gates name metrics this eval measures; the text reads
    plan = AutoPlan(0.0, {}, {})
    trials: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix=".llmopt-gate-", dir=cfg.output.resolve().parent))
    best: tuple[Path, QuantReport] | None = None
    baseline = BaselineCache()  # the source model is scored once, by the first trial

    def trial(bits: float) -> bool:
        nonlocal best
        out = work / f"bits-{bits:.4f}"
        console.print(f"[cyan]gate search:[/] trying {bits:.3f} bits per weight", highlight=False)
        report = pipeline.quantize_model(cfg.model_copy(update={"target_bits": bits, "gate": [], "output": out}),
                                         console, plan=plan)
        ev = run_eval(_eval_options(cfg, str(out)), baseline_cache=baseline)
        passed = ev.passed
        assert report.auto is not None
        trials.append({"target_bits": round(bits, 4), "bits": report.auto["bits"], "passed": passed,
                       "bytes": report.bytes_after, "measured_kl": report.auto["measured_kl"],
                       "gates": [{"gate": getattr(g, "expression", g.gate.expression), "value": g.value,
                                  "passed": g.passed} for g in ev.gates]})
        console.print(f"[cyan]gate search:[/] {report.auto['bits']:.3f} bits: "
                      f"{'passes' if passed else 'fails'} ({_said_all(trials[-1])})", highlight=False)
        if passed:
            if best is not None:
                shutil.rmtree(best[0], ignore_errors=True)
            best = (out, report)
        else:
            shutil.rmtree(out, ignore_errors=True)
        return passed

    try:
        lo, hi = auto_bounds(cfg)
        if not trial(hi):
            raise GateFailed(f"no checkpoint passes {' and '.join(cfg.gate)}: even {hi:.3f} bits per weight "
                             f"fails ({_said_all(trials[-1])})")
        if lo < hi and not trial(lo):
            while hi - lo > TOLERANCE_BITS:
                mid = (lo + hi) / 2
                if trial(mid):
                    hi = mid
                else:
                    lo = mid
        assert best is not None
        out, report = best
        report.gate_search = {"gates": cfg.gate, "eval_data": str(cfg.eval_data), "tolerance_bits": TOLERANCE_BITS,
                              "trials": trials}
        report.output = str(cfg.output)
        report.write(out / REPORT)
        with atomic_directory(cfg.output, cfg.overwrite) as tmp:
            for f in out.iterdir():
                shutil.move(str(f), tmp / f.name)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _said_all(trial: dict[str, Any]) -> str:
    return "; ".join(f"{g['gate']} = {g['value']:.4g}" if g["value"] is not None else g["gate"]
                     for g in trial["gates"])
