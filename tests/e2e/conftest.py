from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.serving import SERVER_OPTIONS, Server


@pytest.fixture(scope="session")
def serial_tp1(tiny_model: Path) -> Iterator[Server]:
    """TP=1 with every step in series (--no-async-scheduling): what the overlapped loop must match.
    The session's, as server_tp1 is: test_overlap and test_vllm_client both compare against it, and
    a start is most of what either costs."""
    server = Server(tiny_model, tp=1, extra=(*SERVER_OPTIONS, "--no-async-scheduling"))
    try:
        yield server
    finally:
        server.stop()
