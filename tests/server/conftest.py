"""Fixtures for the HTTP-layer tests: the real SmolLM2 tokenizer, the fake engine, the app in-process
(TestClient) and under a real uvicorn server on a loopback port."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from server.fake_engine import MODEL_NAME, FakeEngine, LiveServer, default_model_path, free_port

from tp_runtime.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine, tokenizer: Tokenizer):
    from fastapi.testclient import TestClient

    from tp_runtime.http import ServerSettings, create_app

    with TestClient(create_app(engine, tokenizer, ServerSettings((MODEL_NAME,)))) as test_client:
        yield test_client


@pytest.fixture
def live_server(tokenizer: Tokenizer) -> Iterator[LiveServer]:
    """The app under a real uvicorn on a free loopback port, configured as the frontend runs it
    (tp_runtime/http/server.py: httptools with the head deadline, uvloop), in a thread that is
    stopped after."""
    from tp_runtime.http import ServerSettings, create_app
    from tp_runtime.http.server import http_server

    engine = FakeEngine(token_delay_s=0.01)
    port = free_port()
    app = create_app(engine, tokenizer, ServerSettings((MODEL_NAME,), bind_host="127.0.0.1"))
    server = http_server(app, "127.0.0.1", port, "warning", timeout_keep_alive=5, request_header_timeout=10.0)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("uvicorn did not start within 10 s")
            time.sleep(0.02)
        yield LiveServer(f"http://127.0.0.1:{port}", engine)
    finally:
        server.stop()
        thread.join(timeout=10)
