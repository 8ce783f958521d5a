"""SIGTERM drains: no new requests, the running one finishes, then a clean exit."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.e2e.serving import SERVER_OPTIONS, Server, alive, descendants


def test_sigterm_lets_running_requests_finish_then_exits_cleanly(tiny_model: Path) -> None:
    server = Server(tiny_model, tp=2, extra=SERVER_OPTIONS)
    try:
        group = [server.pid, *descendants(server.pid)]
        results: list[httpx.Response] = []
        started = threading.Event()

        def long_request() -> None:
            started.set()
            body = {"prompt": "drain me", "max_tokens": 120, "ignore_eos": True, "temperature": 0}
            results.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=120))

        worker = threading.Thread(target=long_request)
        worker.start()
        started.wait()
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/metrics", timeout=5).text.find("tp_runtime_requests_running 1.0") < 0:
            assert time.monotonic() < deadline, "the request never started running"
            time.sleep(0.05)
        os.kill(server.pid, signal.SIGTERM)
        refused = None
        while worker.is_alive():
            try:
                late = httpx.post(f"{server.url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
                if late.status_code != 200:
                    refused = late
                    break
            except httpx.HTTPError:
                break
            time.sleep(0.05)
        worker.join(timeout=120)
        assert results and results[0].status_code == 200, results[0].text if results else "no answer"
        assert results[0].json()["usage"]["completion_tokens"] == 120
        if refused is not None:
            assert refused.status_code == 503, refused.text
        assert server.process.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while alive(group) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(group), f"processes left behind: {alive(group)}"
    finally:
        server.stop()
