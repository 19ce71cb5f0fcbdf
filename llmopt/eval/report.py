"""Render an EvalReport: a rich table for people, JSON for CI, Markdown for pull requests.

The Markdown file is written atomically (`llmopt.io`: temporary file in the same folder, then `os.replace`), so a
CI job that uploads it never sees half a report, and a failed run never leaves a stale one half
overwritten.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from llmopt.eval.compare import EvalReport, MetricRow
from llmopt.io import check_output_file, write_text_atomic

# metrics whose value is a fraction shown as a percentage, and those already in points/percent
_FRACTION = ("acc", "acc_norm", "acc_bytes", "exact_match", "top1_agreement")


def _fmt(x: float | None, name: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    base = name.rsplit(".", 1)[-1]
    if base in _FRACTION:
        return f"{100 * x:.2f}%"
    if abs(x) >= 1000:
        return f"{x:,.1f}"
    return f"{x:.4g}"


def _fmt_delta(row: MetricRow) -> str:
    if row.delta is None:
        return "-"
    base = row.name.rsplit(".", 1)[-1]
    if base in _FRACTION:
        return f"{100 * row.delta:+.2f} pts"
    return f"{row.delta:+.4g}"


def _fmt_stderr(row: MetricRow) -> str:
    if row.stderr is None or math.isnan(row.stderr):
        return "-"
    base = row.name.rsplit(".", 1)[-1]
    return f"±{100 * row.stderr:.2f}%" if base in _FRACTION else f"±{row.stderr:.3g}"


def _status(row: MetricRow) -> str:
    return row.verdict or ("" if row.passed is None else ("PASS" if row.passed else "FAIL"))


def _fmt_interval(row: MetricRow) -> str:
    """The paired 95% interval in the row's own unit (percent for fractions)."""
    e = row.interval
    if e is None or e.low is None or e.high is None:
        return "-"
    scale = 100.0 if row.name.rsplit(".", 1)[-1] in _FRACTION else 1.0
    unit = "%" if scale == 100.0 else ""
    return f"[{scale * e.low:.3g}{unit}, {scale * e.high:.3g}{unit}]"


def _fmt_p(row: MetricRow) -> str:
    e = row.interval
    return "-" if e is None or e.p_value is None else f"{e.p_value:.3g}"


def _styled(status: str) -> str:
    return {"PASS": "[green]PASS[/]", "NOT SHOWN": "[yellow]NOT SHOWN[/]", "FAIL": "[bold red]FAIL[/]"}.get(status, "")


def _headline(report: EvalReport) -> str:
    c = report.models["candidate"]
    s = f"candidate {c['model']} ({c['dtype']}, KV {c['kv_cache_dtype']}, {c['device']})"
    if "baseline" in report.models:
        b = report.models["baseline"]
        s += f" vs baseline {b['model']} ({b['dtype']}, KV {b['kv_cache_dtype']})"
    return s


def _protocol(report: EvalReport) -> str | None:
    if report.text is None:
        return None
    p = report.text.protocol
    return (f"perplexity: {report.text.nll[-1].tokens:,} scored tokens of {p['text_tokens']:,}, "
            f"{p['windows']} windows, seq_len {p['seq_len']}, stride {p['stride']} ({p['protocol']}), "
            f"{report.text.seconds:.1f} s")


def render_table(report: EvalReport, console: Console) -> None:
    compare = "baseline" in report.models
    table = Table(title=_headline(report), title_justify="left")
    table.add_column("metric", no_wrap=True)
    if compare:
        table.add_column("baseline", justify="right")
    table.add_column("candidate", justify="right")
    if compare:
        table.add_column("delta", justify="right")
    table.add_column("stderr", justify="right")
    table.add_column("gate", overflow="fold")
    for row in report.rows.values():
        gate = f"{_styled(_status(row))} {', '.join(row.gates)}".strip()
        cells = [row.name] + ([_fmt(row.baseline, row.name)] if compare else []) + [_fmt(row.candidate, row.name)]
        cells += ([_fmt_delta(row)] if compare else []) + [_fmt_stderr(row), gate]
        table.add_row(*cells)
    console.print(table)
    paired = [r for r in report.rows.values() if r.interval is not None]
    if paired:  # a second, narrow table: an 80-column CI log keeps every number
        t = Table(title="paired differences (same items on both sides)", title_justify="left")
        for name, justify in (("metric", "left"), ("point", "right"), ("95% interval", "right"),
                              ("over", "right"), ("p (McNemar)", "right")):
            t.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
        for r in paired:
            e = r.interval
            assert e is not None
            t.add_row(r.name, _fmt(e.point, r.name), _fmt_interval(r), f"{e.n} {e.unit}", _fmt_p(r))
        console.print(t)
    proto = _protocol(report)
    if proto:
        console.print(f"[dim]{proto}[/]")
    for name, roles in report.tasks.items():
        for role, r in roles.items():
            console.print(f"[dim]{name} ({role}): {r.n} docs via {r.harness}, {r.seconds:.1f} s[/]")
    for line in _bisect_lines(report):
        console.print(line, highlight=False, soft_wrap=True)
    if report.gates:
        verdict = "[green]all gates passed[/]" if report.passed else "[bold red]gate(s) failed[/]"
        console.print(verdict + ":", highlight=False)
        for g in report.gates:
            console.print("  " + g.describe(), markup=False, highlight=False, soft_wrap=True)


def _bisect_lines(report: EvalReport, top: int = 8) -> list[str]:
    """Plain lines (shared by the terminal and Markdown) summarizing the bisection."""
    b = report.bisect
    if b is None:
        return []
    c = b.candidate
    out = [f"bisect over {b.tokens:,} tokens: candidate KL {c.kl_div:.4g}, top-1 {100 * c.top1_agreement:.2f}%, "
           f"ppl {c.ppl_increase_pct:+.2f}%"]
    for f in b.factors:
        out.append(f"without {f['what']}: KL {f['kl_div']:.4g} (removes {100 * f['share_of_kl']:.0f}% of it), "
                   f"top-1 {100 * f['top1_agreement']:.2f}%, ppl {f['ppl_increase_pct']:+.2f}%")
    if b.layers:
        ranked = sorted(b.layers, key=lambda r: -r["kl_removed"])[:top]
        out.append("most sensitive layers (KL removed by restoring one): " +
                   ", ".join(f"{r['layer']} ({r['kl_removed']:.3g})" for r in ranked))
    if b.suggestion:
        s = b.suggestion
        verdict = "meets" if s["meets_gates"] else "still fails"
        out.append(f"suggestion: keep layers {s['layers']} unquantized ({verdict} {', '.join(s['gates'])}: "
                   f"KL {s['after']['kl_div']:.4g}, top-1 {100 * s['after']['top1_agreement']:.2f}%): " +
                   " ".join(f"--ignore '{r}'" for r in s["ignore"]))
    if b.plot:
        out.append(f"plot: {b.plot}")
    return out


def render_markdown(report: EvalReport) -> str:
    compare = "baseline" in report.models
    lines = ["# llmopt eval report", "", _headline(report), ""]
    head = ["metric"] + (["baseline"] if compare else []) + ["candidate"] + (["delta"] if compare else [])
    head += ["stderr"] + (["95% interval", "p (McNemar)"] if compare else []) + ["gate"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in report.rows.values():
        cells = [f"`{row.name}`"] + ([_fmt(row.baseline, row.name)] if compare else [])
        cells += [_fmt(row.candidate, row.name)] + ([_fmt_delta(row)] if compare else [])
        gate = f"{'**' + _status(row) + '**' if _status(row) else ''} {', '.join(f'`{g}`' for g in row.gates)}"
        cells += [_fmt_stderr(row)] + ([_fmt_interval(row), _fmt_p(row)] if compare else []) + [gate.strip()]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    proto = _protocol(report)
    if proto:
        lines += [f"- {proto}"]
    for name, roles in report.tasks.items():
        for role, r in roles.items():
            lines.append(f"- task `{name}` ({role}): {r.n} docs via {r.harness}, {r.seconds:.1f} s")
    if report.bisect is not None:
        lines += ["", "## Bisect", ""] + [f"- {x}" for x in _bisect_lines(report)]
    if report.gates:
        lines += ["", "## Gates", ""]
        lines += [f"- {g.describe()}" for g in report.gates]
        lines += ["", f"**{'All gates passed.' if report.passed else 'Gate(s) failed.'}**"]
    lines.append("")
    return "\n".join(lines)


def check_report_path(path: Path) -> Path:
    """--report's file: its folder must exist (a typo in --report is not a new folder) and take a file."""
    return check_output_file(path, "--report", new_folders=False)


def write_atomic(path: Path, text: str) -> None:
    """Write the report file atomically."""
    write_text_atomic(check_report_path(path), text)


def _finite(obj):
    """NaN/inf are not JSON: an unmeasured value is null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def render_json(report: EvalReport) -> str:
    return json.dumps(_finite(report.to_json()), indent=2, default=str)
