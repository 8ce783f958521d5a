from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.serving import SERVER_OPTIONS, Server
from tests.tiny_models import write_tiny_llama


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), num_heads=6, num_kv_heads=3)


@pytest.fixture(scope="session")
def server_tp2(tiny_model: Path) -> Iterator[Server]:
    server = Server(tiny_model, tp=2, extra=SERVER_OPTIONS)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def server_tp1(tiny_model: Path) -> Iterator[Server]:
    server = Server(tiny_model, tp=1, extra=SERVER_OPTIONS)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def serial_tp1(tiny_model: Path) -> Iterator[Server]:
    """TP=1 with every step in series (--no-async-scheduling): what the overlapped loop must match."""
    server = Server(tiny_model, tp=1, extra=(*SERVER_OPTIONS, "--no-async-scheduling"))
    try:
        yield server
    finally:
        server.stop()
