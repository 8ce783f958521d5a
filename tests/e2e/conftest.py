from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.serving import SERVER_OPTIONS, Server


@pytest.fixture(scope="module")
def serial_tp1(tiny_model: Path) -> Iterator[Server]:
    """TP=1 with every step in series (--no-async-scheduling): what the overlapped loop must match."""
    server = Server(tiny_model, tp=1, extra=(*SERVER_OPTIONS, "--no-async-scheduling"))
    try:
        yield server
    finally:
        server.stop()
