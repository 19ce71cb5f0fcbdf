"""Run `llmopt ARGS` through the real `cli.main()` in the test process."""

from __future__ import annotations

import sys

from rich.console import Console

import llmopt.cli as cli


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `llmopt ARGS`; the consoles are wide so no line wraps."""
    monkeypatch.setattr(sys, "argv", ["llmopt", *args])
    monkeypatch.setattr(cli, "console", Console(width=250))
    monkeypatch.setattr(cli, "err_console", Console(width=250, stderr=True))
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
