"""One HTML page from sections: escaping, tables, figures, the gate table, and the atomic write.

Everything a page holds is inline (a short style sheet, SVG figures from `report.figures`), so the file
can be mailed, uploaded as a CI artifact or opened offline and looks the same: no script, no link, no
font or image fetched. Text from the run (model names, gate expressions, notes) is always escaped; the
only unescaped HTML is what this module and the figure renderer build (`Raw`).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from llmopt._version import __version__
from llmopt.errors import LlmoptError
from llmopt.gates import ConfidenceGate, GateResult, IntervalGateResult, check_interval_gate
from llmopt.io import check_output_file, write_text_atomic

VERDICTS = ("PASS", "NOT SHOWN", "FAIL")

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:2rem auto;max-width:1100px;
padding:0 1rem;color:#1b1f23;line-height:1.45}
h1{font-size:1.6rem;margin-bottom:.2rem}h2{font-size:1.25rem;border-bottom:1px solid #d0d7de;padding-bottom:.2rem;
margin-top:2rem}h3{font-size:1.05rem}
.meta{color:#57606a;margin:.1rem 0}nav a{margin-right:1rem}
table{border-collapse:collapse;margin:.6rem 0;font-size:.9rem}
th,td{border:1px solid #d0d7de;padding:.25rem .55rem;text-align:left;vertical-align:top}
th{background:#f6f8fa}td.num{text-align:right;font-variant-numeric:tabular-nums}
.PASS{color:#116329;font-weight:600}.FAIL{color:#cf222e;font-weight:600}
.NOT-SHOWN{color:#9a6700;font-weight:600}
figure{margin:1rem 0}figure svg{max-width:100%;height:auto}figcaption{color:#57606a;font-size:.85rem}
.note{color:#57606a;font-size:.9rem}code{background:#f6f8fa;padding:0 .2rem}
"""


class Raw(str):
    """HTML built here (a table, a figure): inserted as is. Any other str is escaped."""


def esc(value: object) -> str:
    """Text (or a number) as HTML; `Raw` passes through."""
    if isinstance(value, Raw):
        return value
    return html.escape("" if value is None else str(value), quote=True)


def num(x: float | int | None, digits: int = 4) -> str:
    """A number to `digits` significant digits; `-` when missing or NaN."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.1f}" if abs(x) >= 10 ** digits else f"{x:.{digits}g}"


def table(head: Sequence[str], rows: Sequence[Sequence[object]], numeric: Sequence[int] = ()) -> Raw:
    """A table; cells are escaped unless `Raw`; columns listed in `numeric` are right-aligned."""
    cols = "".join(f"<th>{esc(h)}</th>" for h in head)
    body = []
    for row in rows:
        cells = "".join(f'<td class="num">{esc(c)}</td>' if i in numeric else f"<td>{esc(c)}</td>"
                        for i, c in enumerate(row))
        body.append(f"<tr>{cells}</tr>")
    return Raw(f"<table><thead><tr>{cols}</tr></thead><tbody>{''.join(body)}</tbody></table>")


def verdict_cell(verdict: str) -> Raw:
    """PASS / NOT SHOWN / FAIL, coloured (the class names the verdict, for readers and tests)."""
    return Raw(f'<span class="verdict {verdict.replace(" ", "-")}">{esc(verdict)}</span>')


def figure(svg: str, caption: str, fig_id: str) -> Raw:
    """An inline SVG figure with its caption."""
    return Raw(f'<figure id="{esc(fig_id)}" class="figure">{svg}<figcaption>{esc(caption)}</figcaption></figure>')


def paragraph(text: str, cls: str | None = None) -> Raw:
    attr = f' class="{esc(cls)}"' if cls else ""
    return Raw(f"<p{attr}>{esc(text)}</p>")


def bullet_list(items: Sequence[object]) -> Raw:
    return Raw("<ul>" + "".join(f"<li>{esc(i)}</li>" for i in items) + "</ul>")


@dataclass
class GateRow:
    """One gate as the gate table shows it, whatever command checked it."""

    expression: str
    verdict: str  # PASS, NOT SHOWN or FAIL
    point: float | None = None
    low: float | None = None
    high: float | None = None
    confidence: float | None = None  # of [low, high]
    reads: str = "point"  # what the gate compared with its threshold: point, lower bound, upper bound
    note: str | None = None


def verdict_of(passed: bool, verdict: str | None = None) -> str:
    """PASS / NOT SHOWN / FAIL from a gate's pass flag and, for a confidence gate, its own verdict."""
    if verdict:
        return {"pass": "PASS", "fail": "FAIL", "not shown": "NOT SHOWN"}.get(verdict.lower(), verdict.upper())
    return "PASS" if passed else "FAIL"


def gate_rows(results: Sequence[GateResult]) -> list[GateRow]:
    """Checked gates (`llmopt.gates`): a plain one reads its point, a confidence one a bound of its interval.

    `bench --ab`'s interval gates carry their ratio estimate (`estimate`: ratio, low, high, confidence) and
    only pass or fail; their verdict here is the shared one (`check_interval_gate`), so a failure the
    interval cannot show (it straddles the threshold) reads NOT SHOWN, as in eval."""
    rows = []
    for r in results:
        est = getattr(r, "estimate", None)
        if est is not None and not isinstance(r, IntervalGateResult):
            cg = ConfidenceGate(gate=r.gate, confidence=est.confidence)
            r = check_interval_gate(cg, est.ratio, est.low, est.high).model_copy(
                update={"expression": getattr(r, "expression", cg.expression)})
        if isinstance(r, IntervalGateResult):
            reads = "lower bound" if r.gate.op in (">=", ">") else "upper bound"
            rows.append(GateRow(r.expression, verdict_of(r.passed, r.verdict), r.point, r.low, r.high,
                                r.confidence, reads, r.note))
        else:
            rows.append(GateRow(r.gate.expression, verdict_of(r.passed), r.value,
                                note=None if r.value is not None else "not measured"))
    return rows


def gate_table(rows: Sequence[GateRow]) -> Raw:
    """Gate, point estimate, interval, what the gate read, verdict, note."""
    out = []
    for g in rows:
        interval = "-" if g.low is None or g.high is None else (
            f"[{num(g.low)}, {num(g.high)}]" + ("" if g.confidence is None else f" ({100 * g.confidence:g}%)"))
        out.append([Raw(f"<code>{esc(g.expression)}</code>"), num(g.point), interval, g.reads,
                    verdict_cell(g.verdict), g.note or ""])
    return table(["gate", "point estimate", "interval", "gate reads", "verdict", "note"], out, numeric=(1, 2))


@dataclass
class Section:
    """A titled part of the page; `body` is built from the helpers above."""

    id: str
    title: str
    parts: list[str] = field(default_factory=list)

    def add(self, *parts: str) -> Section:
        self.parts += [esc(p) if not isinstance(p, Raw) else p for p in parts]
        return self


def render_page(title: str, sections: Sequence[Section], meta: Sequence[str] = ()) -> str:
    """The whole document: one file, inline style, the sections in order with a table of contents."""
    made = datetime.now(UTC).isoformat(timespec="seconds")
    nav = " ".join(f'<a href="#{esc(s.id)}">{esc(s.title)}</a>' for s in sections)
    lines = "".join(f'<p class="meta">{esc(m)}</p>' for m in [*meta, f"written {made} by llmopt {__version__}"])
    body = "".join(f'<section id="{esc(s.id)}"><h2>{esc(s.title)}</h2>{"".join(s.parts)}</section>'
                   for s in sections)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{esc(title)}</title><style>{_CSS}</style></head>"
            f"<body><h1>{esc(title)}</h1>{lines}<nav>{nav}</nav>{body}</body></html>\n")


def check_html_path(path: str | Path, flag: str = "--html") -> Path:
    """Refuse, before any work, a path the page cannot be written to (one line, exit 2)."""
    return check_output_file(path, flag, new_folders=False)


def write_html(path: str | Path, text: str, flag: str = "--html") -> Path:
    """Write the page atomically (temp file beside it, then os.replace); a bad path is one LlmoptError."""
    p = check_html_path(path, flag)
    try:
        return write_text_atomic(p, text)
    except OSError as e:
        raise LlmoptError(f"cannot write {flag} {path}: {e.strerror or e}") from None
