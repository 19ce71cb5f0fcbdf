from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.serve._server import RunningServer, serve


@pytest.fixture(scope="package")
def server(tiny_llama) -> Iterator[RunningServer]:
    """The shared server for tests that do not change its configuration."""
    with serve(tiny_llama) as srv:
        yield srv
