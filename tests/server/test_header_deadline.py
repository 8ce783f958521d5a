"""The HTTP server's deadline on request heads: a slowloris client is cut off, a prompt one and a
keep-alive connection's next request are not."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from tp_runtime.http.header_deadline import protocol_with_header_timeout

DEADLINE_S = 0.6


async def app(scope, receive, send) -> None:  # noqa: ANN001 - the smallest ASGI app
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def port() -> Iterator[int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(
        app, host="127.0.0.1", port=port, lifespan="off", log_level="warning", timeout_keep_alive=30,
        http=protocol_with_header_timeout(DEADLINE_S),
    ))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(timeout=5)


def closed_within(sock: socket.socket, limit_s: float) -> float | None:
    """Seconds until the server closed the connection, or None if it was still open at limit_s."""
    started = time.monotonic()
    sock.settimeout(limit_s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    return time.monotonic() - started


def test_headers_that_never_end_are_cut_off(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for _ in range(3):  # trickling bytes does not buy more time
            time.sleep(DEADLINE_S / 4)
            sock.sendall(b"X")
        took = closed_within(sock, 5 * DEADLINE_S)
        assert took is not None and took < 2 * DEADLINE_S


def test_a_silent_connection_is_closed_too(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        assert closed_within(sock, 5 * DEADLINE_S) is not None


def response(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\r\n\r\nok"):
        chunk = sock.recv(4096)
        assert chunk, f"closed after {data!r}"
        data += chunk
    return data


def test_prompt_requests_and_keep_alive_are_served(port: int) -> None:
    request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        for _ in range(2):
            sock.sendall(request)
            assert response(sock).startswith(b"HTTP/1.1 200")
            time.sleep(DEADLINE_S / 2)
        # A request head that arrives in pieces, in time, is served.
        sock.sendall(request[:10])
        time.sleep(DEADLINE_S / 3)
        sock.sendall(request[10:])
        assert response(sock).startswith(b"HTTP/1.1 200")


def test_pipelined_requests_are_served_and_the_idle_deadline_follows(port: int) -> None:
    request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        sock.sendall(request * 2)  # the second head arrives while the first is answered
        data = b""
        while data.count(b"\r\n\r\nok") < 2:
            chunk = sock.recv(4096)
            assert chunk, f"closed after {data!r}"
            data += chunk
        assert data.count(b"HTTP/1.1 200") == 2
        took = closed_within(sock, 5 * DEADLINE_S)  # no third head: the deadline is armed again
        assert took is not None and took < 2 * DEADLINE_S


def test_the_deadline_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        protocol_with_header_timeout(0)
    assert asyncio.iscoroutinefunction(app)
