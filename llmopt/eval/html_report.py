"""`llmopt eval --html`: the eval report as sections of a self-contained HTML page (`llmopt.report`).

Built from the report's JSON form (`render_json`), so the same sections serve the command and a recipe's
`summary.html`, which reads `eval/eval.json` back: the gate table (point estimate, 95% interval, what the
gate read, PASS / NOT SHOWN / FAIL and what would decide it), every metric with its paired interval, a
figure of the task drops' intervals, and `--bisect`'s per-layer sensitivity when it ran.
"""

from __future__ import annotations

import json
from typing import Any

from llmopt.eval.metrics import is_fraction
from llmopt.report.figures import bars_svg, intervals_svg
from llmopt.report.html import (
    GateRow,
    Raw,
    Section,
    bullet_list,
    esc,
    figure,
    gate_table,
    num,
    paragraph,
    render_page,
    table,
    verdict_of,
)


def eval_gate_rows(data: dict[str, Any]) -> list[GateRow]:
    """The gates of an eval JSON: a confidence gate with its own interval; a plain gate reads the point and
    shows the metric's paired 95% interval beside it when it has one."""
    rows = []
    for g in data.get("gates") or []:
        if g.get("verdict") is not None:
            reads = "lower bound" if any(op in g["gate"] for op in (">=", ">")) else "upper bound"
            rows.append(GateRow(g["gate"], verdict_of(g["pass"], g["verdict"]), g.get("point"), g.get("low"),
                                g.get("high"), g.get("confidence"), reads, g.get("note")))
            continue
        iv = ((data.get("metrics") or {}).get(g["metric"]) or {}).get("interval") or {}
        rows.append(GateRow(g["gate"], verdict_of(g["pass"]), g.get("value"), iv.get("low"), iv.get("high"),
                            iv.get("confidence") if iv.get("low") is not None else None, "point",
                            None if g.get("value") is not None else "not measured"))
    return rows


def _value(x: float | None, name: str) -> str:
    return "-" if x is None else (f"{100 * x:.2f}%" if is_fraction(name) else num(x))


def _metrics_table(data: dict[str, Any]) -> Raw:
    compare = "baseline" in (data.get("models") or {})
    head = ["metric"] + (["baseline"] if compare else []) + ["candidate"] + (["delta"] if compare else [])
    head += ["stderr", "95% interval", "over", "p (McNemar)"]
    rows = []
    for name, m in (data.get("metrics") or {}).items():
        iv = m.get("interval") or {}
        scale, unit = (100.0, "%") if is_fraction(name) else (1.0, "")
        interval = "-" if iv.get("low") is None or iv.get("high") is None else \
            f"[{num(scale * iv['low'])}{unit}, {num(scale * iv['high'])}{unit}]"
        row: list[object] = [Raw(f"<code>{esc(name)}</code>")]
        row += [_value(m.get("baseline"), name)] if compare else []
        row += [_value(m.get("candidate"), name)]
        row += [_value(m.get("delta"), name)] if compare else []
        row += [_value(m.get("stderr"), name), interval, f"{iv['n']} {iv.get('unit', '')}" if iv.get("n") else "-",
                num(iv.get("p_value"))]
        rows.append(row)
    return table(head, rows, numeric=tuple(range(1, len(head))))


def _drops_figure(data: dict[str, Any]) -> Raw | None:
    """Each comparison's paired interval in its unit, drops in points (0: no change)."""
    rows = []
    for name, m in (data.get("metrics") or {}).items():
        iv = m.get("interval") or {}
        if name.endswith("_drop") and iv.get("point") is not None:
            rows.append((name, iv["point"], iv.get("low"), iv.get("high")))
    svg = intervals_svg("eval-drops", rows, 0.0, "drop (points): baseline - candidate", "paired 95% intervals of the drops")
    return None if svg is None else figure(svg, "Accuracy drops with their paired 95% intervals (Agresti-Min); a "
                                           "gate acc_drop<=M@95 passes when the interval ends left of M.",
                                           "fig-eval-drops")


def _bisect_section(b: dict[str, Any]) -> Section:
    s = Section("bisect", "Bisect: per-layer sensitivity")
    c = b["candidate"]
    s.add(paragraph(f"Over {b['tokens']:,} tokens: candidate KL {num(c['kl_div'])}, top-1 "
                    f"{100 * c['top1_agreement']:.2f}%, ppl {c['ppl_increase_pct']:+.2f}%."))
    if b.get("factors"):
        s.add(Raw("<h3>Optimizations one at a time</h3>"), table(
            ["turned off", "KL", "share of KL removed", "top-1", "ppl change"],
            [[f["what"], num(f["kl_div"]), f"{100 * f['share_of_kl']:.0f}%", f"{100 * f['top1_agreement']:.2f}%",
              f"{f['ppl_increase_pct']:+.2f}%"] for f in b["factors"]], numeric=(1, 2, 3, 4)))
    layers = b.get("layers") or []
    if layers:
        chosen = set((b.get("suggestion") or {}).get("layers", []))
        svg = bars_svg("eval-bisect", [r["layer"] for r in layers], [r["kl_removed"] for r in layers], chosen,
                       "KL removed by restoring one layer" + (" (red: suggested --ignore)" if chosen else ""),
                       "decoder layer restored from the baseline", "KL removed (nats/token)",
                       (c["kl_div"], f"candidate KL {c['kl_div']:.4g}"))
        s.add(figure(svg, "Per-layer sensitivity: the KL divergence each decoder layer removes when restored from "
                     "the baseline.", "fig-bisect-layers"))
        ranked = sorted(layers, key=lambda r: -r["kl_removed"])[:8]
        s.add(table(["layer", "KL removed", "KL", "top-1", "ppl change"],
                    [[r["layer"], num(r["kl_removed"]), num(r["kl_div"]), f"{100 * r['top1_agreement']:.2f}%",
                      f"{r['ppl_increase_pct']:+.2f}%"] for r in ranked], numeric=(0, 1, 2, 3, 4)))
    sug = b.get("suggestion")
    if sug:
        verdict = "meets" if sug["meets_gates"] else "still fails"
        s.add(paragraph(f"Suggestion: keep layers {sug['layers']} unquantized ({verdict} {', '.join(sug['gates'])}): "
                        + " ".join(f"--ignore '{r}'" for r in sug["ignore"])))
    return s


def eval_sections(data: dict[str, Any], gates: bool = True, prefix: str = "") -> list[Section]:
    """The sections of one eval report (its JSON form); `gates=False` leaves the gate table to the caller."""
    sections = []
    if gates and data.get("gates"):
        g = Section(f"{prefix}gates", "Quality gates")
        g.add(gate_table(eval_gate_rows(data)),
              paragraph("A gate METRIC<=M@95 reads the upper bound of the paired 95% interval (>= reads the lower): "
                        "PASS when the bound meets M, FAIL when the whole interval is past it, NOT SHOWN when the "
                        "interval straddles M (too few items to tell; it does not pass).", "note"))
        sections.append(g)
    m = Section(f"{prefix}metrics", "Eval metrics")
    models = data.get("models") or {}
    m.add(bullet_list([f"{role}: {d.get('model')} ({d.get('dtype')}, KV {d.get('kv_cache_dtype')}, {d.get('device')})"
                       for role, d in models.items()]))
    m.add(_metrics_table(data))
    fig = _drops_figure(data)
    if fig is not None:
        m.add(fig)
    ppl = data.get("perplexity")
    notes = []
    if ppl:
        p = ppl["protocol"]
        notes.append(f"perplexity: {ppl['candidate']['tokens']:,} scored tokens of {p['text_tokens']:,}, "
                     f"{p['windows']} windows, seq_len {p['seq_len']}, stride {p['stride']}")
    for name, roles in (data.get("tasks") or {}).items():
        notes += [f"task {name} ({role}): {r['n']} docs via {r['harness']}" for role, r in roles.items()]
    if notes:
        m.add(bullet_list(notes))
    sections.append(m)
    if data.get("bisect"):
        b = _bisect_section(data["bisect"])
        b.id = f"{prefix}{b.id}"
        sections.append(b)
    return sections


def eval_page(report: Any) -> str:
    """The whole `--html` page of an `EvalReport`."""
    from llmopt.eval.report import render_json

    data = json.loads(render_json(report))
    verdict = "no gates" if not data.get("gates") else ("all gates passed" if data["passed"] else "gate(s) failed")
    c = data["models"]["candidate"]["model"]
    title = f"llmopt eval: {c}" + (f" vs {data['models']['baseline']['model']}" if "baseline" in data["models"] else "")
    return render_page(title, eval_sections(data), meta=[verdict])
