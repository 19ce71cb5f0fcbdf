"""Fixtures for the recipe tests: one intra-op thread for every engine a recipe test starts."""

from __future__ import annotations

from tests.shared_fixtures import _one_thread

__all__ = ["_one_thread"]
