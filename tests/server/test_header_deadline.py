"""The HTTP server's bounds on request heads: a slowloris client is cut off, a prompt one and a
keep-alive connection's next request are not; a head over MAX_HEAD_BYTES is refused with 431."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from tp_runtime.http.header_deadline import MAX_HEAD_BYTES, protocol_with_header_timeout

DEADLINE_S = 0.6


async def app(scope, receive, send) -> None:  # noqa: ANN001 - the smallest ASGI app
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":  # answered after longer than the head deadline
        await asyncio.sleep(1.5 * DEADLINE_S)
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
        # The second head arrives while the first is answered, and its answer takes longer than
        # the deadline: no deadline runs while a request is served.
        sock.sendall(request + request.replace(b"GET / ", b"GET /slow "))
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


def test_a_head_over_the_bound_is_refused_with_431_and_one_under_it_is_served(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Fill: " + b"a" * (MAX_HEAD_BYTES // 2) + b"\r\n\r\n")
        assert response(sock).startswith(b"HTTP/1.1 200")
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Fill: ")
        answer = b""
        try:
            for _ in range(16):  # a header line that never ends, MAX_HEAD_BYTES at a time
                time.sleep(0.01)
                sock.sendall(b"a" * MAX_HEAD_BYTES)
        except (BrokenPipeError, ConnectionResetError):
            pass
        while chunk := sock.recv(4096):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), answer[:200]
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"


def test_a_malformed_request_is_answered_400_in_the_apis_json_shape(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        sock.sendall(b"GET / HTTP/1.1\r\nHost x\r\n\r\n")  # a header line without its colon
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad Request") and b"content-type: application/json" in head
    error = json.loads(body)["error"]
    assert error["code"] == "malformed_http" and "not well-formed HTTP/1.1" in error["message"]
