"""What a run did, per stage: `summary.json` for machines, `summary.md` for people (and `summary.html`, the
same with figures: `summary_html.py`), a table for the terminal.

Per stage: its status (ran, skipped because unchanged, failed, not run because an earlier stage
stopped the run, not selected by `--stages`; in a dry run: would run / would skip), why, how long it
took, its key metrics and its gates with pass/fail. The failed gates, named with their stage, decide
the exit code (1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llmopt.recipe.state import GateRecord
from llmopt.units import format_bytes

Status = Literal["ran", "skipped", "failed", "not_run", "not_selected", "would_run", "would_skip"]
_STYLE = {"ran": "green", "skipped": "cyan", "failed": "bold red", "not_run": "yellow", "not_selected": "dim",
          "would_run": "green", "would_skip": "cyan"}


@dataclass
class StageReport:
    name: str
    status: Status
    reason: str = ""
    duration_s: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    gates: list[GateRecord] = field(default_factory=list)
    artifact: str | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "reason": self.reason,
                "duration_s": None if self.duration_s is None else round(self.duration_s, 3),
                "metrics": self.metrics, "gates": [g.model_dump() for g in self.gates],
                "artifact": self.artifact, "error": self.error}


@dataclass
class RunReport:
    recipe: str
    run_dir: str
    description: str | None
    stages: list[StageReport]
    started_at: str
    duration_s: float = 0.0
    dry_run: bool = False
    skipped_gates: list[str] = field(default_factory=list)  # `section: gate`, left out by --skip-gate

    @property
    def failed_gates(self) -> list[str]:
        return [f"{s.name}: {g.failure()}" for s in self.stages for g in s.gates if not g.passed]

    @property
    def failed_stage(self) -> StageReport | None:
        return next((s for s in self.stages if s.status == "failed"), None)

    @property
    def exit_code(self) -> int:
        if self.failed_stage is not None and not self.failed_gates:
            return 2
        return 1 if self.failed_gates else 0

    def gate_failure(self) -> str | None:
        """One line naming every failed gate, or None."""
        failed = self.failed_gates
        return f"{len(failed)} gate(s) failed: " + "; ".join(failed) if failed else None

    def to_json(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "run_dir": self.run_dir, "description": self.description,
                "started_at": self.started_at, "duration_s": round(self.duration_s, 3), "dry_run": self.dry_run,
                "passed": not self.failed_gates and self.failed_stage is None, "exit_code": self.exit_code,
                "failed_gates": self.failed_gates, "skipped_gates": self.skipped_gates,
                "stages": [s.to_json() for s in self.stages]}


def format_value(name: str, value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, int) and name.endswith("bytes"):
        return format_bytes(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
        return "[" + ", ".join(f"{v:.4g}" for v in value) + "]"  # an interval
    return str(value)


def _duration(s: StageReport) -> str:
    return "" if s.duration_s is None else f"{s.duration_s:.1f} s"


def render_markdown(report: RunReport) -> str:
    title = "llmopt run (dry run)" if report.dry_run else "llmopt run"
    lines = [f"# {title}: `{report.recipe}`", ""]
    if report.description:
        lines += [report.description.strip(), ""]
    if report.skipped_gates:
        lines += ["**Gates skipped** (`--skip-gate`): " + "; ".join(f"`{g}`" for g in report.skipped_gates), ""]
    verdict = ("All gates passed." if report.exit_code == 0 else
               "Gate(s) failed." if report.failed_gates else "A stage failed.")
    lines += [f"Run directory `{report.run_dir}`, started {report.started_at}, {report.duration_s:.1f} s. "
              f"**{verdict}**", "", "| stage | status | time | gates | note |", "|---|---|---|---|---|"]
    for s in report.stages:
        gates = ", ".join(f"{'✅' if g.passed else '❌'} `{g.gate}`" for g in s.gates)
        note = (s.error or s.reason).replace("|", "\\|")
        lines.append(f"| {s.name} | {s.status.replace('_', ' ')} | {_duration(s)} | {gates} | {note} |")
    for s in report.stages:
        if not s.metrics and not s.gates:
            continue
        lines += ["", f"## {s.name}", ""]
        lines += [f"- `{k}`: {format_value(k, v)}" for k, v in s.metrics.items()]
        lines += [f"- gate {g.describe()}" for g in s.gates]
    if report.failed_gates:
        lines += ["", "## Failed gates", ""] + [f"- {g}" for g in report.failed_gates]
    lines.append("")
    return "\n".join(lines)


def render_table(report: RunReport, console: Console) -> None:
    t = Table(title=f"llmopt run {report.recipe} → {report.run_dir}" + (" (dry run)" if report.dry_run else ""))
    for col in ("stage", "status", "time", "gates", "note"):
        t.add_column(col)
    for s in report.stages:
        gates = "\n".join(f"[{'green' if g.passed else 'red'}]{escape(g.describe())}[/]" for g in s.gates)
        t.add_row(s.name, f"[{_STYLE[s.status]}]{s.status.replace('_', ' ')}[/]", _duration(s), gates,
                  escape(s.error or s.reason))
    console.print(t)
    if report.dry_run:
        return
    if report.exit_code == 0:
        console.print(f"[bold green]all gates passed[/] in {report.duration_s:.1f} s; results in {report.run_dir}")
    elif report.failed_gates:
        console.print("[bold red]gate(s) failed:[/] " + escape("; ".join(report.failed_gates)), highlight=False)


def write_summary(run_dir: Path, report: RunReport) -> None:
    from llmopt.io import write_json_atomic, write_text_atomic
    from llmopt.recipe.summary_html import SUMMARY_HTML, render_html

    write_json_atomic(run_dir / "summary.json", report.to_json())
    write_text_atomic(run_dir / "summary.md", render_markdown(report))
    write_text_atomic(run_dir / SUMMARY_HTML, render_html(report, run_dir))
