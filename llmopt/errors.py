"""User-facing errors. The CLI prints their message on one line and exits with `exit_code`."""

from __future__ import annotations


class LlmoptError(Exception):
    """Bad input or an environment problem the user can fix (exit code 2)."""

    exit_code = 2


class GateFailed(LlmoptError):
    """A quality or performance gate failed (exit code 1)."""

    exit_code = 1
