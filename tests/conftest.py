"""Every test session checks that no process a test started is left running (scripts/harness), and
runs against a disk cache of its own with compiled decode off and a fixed probe (tests/model/hermetic_cache.py).

The tiny model and its TP=1 and TP=2 servers are the session's, shared by tests/e2e and
tests/server: a server's start is most of what a live test costs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.serving import SERVER_OPTIONS, Server
from tests.tiny_models import write_tiny_llama

pytest_plugins = ("scripts.harness.leak_check", "tests.model.hermetic_cache")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), num_heads=6, num_kv_heads=3)


def _server(model: Path, tp: int) -> Iterator[Server]:
    server = Server(model, tp=tp, extra=SERVER_OPTIONS)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def server_tp1(tiny_model: Path) -> Iterator[Server]:
    yield from _server(tiny_model, 1)


@pytest.fixture(scope="session")
def server_tp2(tiny_model: Path) -> Iterator[Server]:
    yield from _server(tiny_model, 2)
