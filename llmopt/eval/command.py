"""`llmopt eval` as one library call: run, print (table or JSON), write the report, enforce gates.

Kept out of cli.py so the CLI stays a parser. Exit codes follow the project convention: a failed gate
raises GateFailed (exit 1, naming the gates) *after* the results are printed and the report written,
so CI logs show what was measured; bad input raises LlmoptError (exit 2) before any model is loaded.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from llmopt.errors import GateFailed
from llmopt.eval.compare import EvalReport, run_eval
from llmopt.eval.options import EvalOptions
from llmopt.eval.report import check_report_path, render_json, render_markdown, render_table, write_atomic
from llmopt.gates import failure_message
from llmopt.report.html import check_html_path, write_html


def eval_command(opts: EvalOptions, as_json: bool = False, console: Console | None = None,
                 err_console: Console | None = None) -> EvalReport:
    console = console or Console()
    err_console = err_console or Console(stderr=True)
    if opts.html is not None:
        check_html_path(opts.html)  # a bad path is exit 2 before any model loads
    if opts.report is not None:
        check_report_path(opts.report)
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=True,
                  disable=not err_console.is_terminal) as bar:
        tasks: dict[str, int] = {}

        def progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done, total=total)

        report = run_eval(opts, progress, notify=lambda line: err_console.print(line, markup=False,
                                                                               highlight=False))
    if as_json:
        sys.stdout.write(render_json(report) + "\n")
    else:
        render_table(report, console)
    if opts.report is not None:
        write_atomic(opts.report, render_markdown(report))
    if opts.html is not None:
        from llmopt.eval.html_report import eval_page

        write_html(opts.html, eval_page(report))
    message = failure_message(report.gates)
    if message:
        raise GateFailed(message)
    return report
