"""The frontend's uvicorn server (tp_runtime.http.server.HttpServer): a housekeeping loop that
wakes once a second, and a stop that does not wait for it."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server.fake_engine import MODEL_NAME, FakeEngine, free_port

from tp_runtime.http import ServerSettings, create_app
from tp_runtime.http import server as http_server_module
from tp_runtime.tokenizer import Tokenizer


def test_stop_ends_the_server_without_waiting_for_its_tick(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    # An hour between ticks: only the wake that stop() sends can end the server within the test.
    monkeypatch.setattr(http_server_module, "TICK_S", 3600.0)
    port = free_port()
    app = create_app(FakeEngine(), tokenizer, ServerSettings((MODEL_NAME,), bind_host="127.0.0.1"))
    server = http_server_module.http_server(app, "127.0.0.1", port, "warning", 5, 10.0)
    ticks: list[int] = []
    on_tick = server.on_tick

    async def counted(counter: int) -> bool:
        ticks.append(counter)
        return await on_tick(counter)

    server.on_tick = counted  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start within 20 s"
            time.sleep(0.02)
        reply = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        assert reply.status_code == 200
        assert reply.headers["date"].endswith(" GMT")  # the first tick set the date header
    finally:
        server.stop()
        thread.join(timeout=30)
    assert not thread.is_alive(), "the server did not end after stop()"
    # Every tick refreshes the date header (uvicorn does so when the counter is a multiple of 10).
    assert ticks and all(counter % 10 == 0 for counter in ticks)
