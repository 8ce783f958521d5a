"""Hostile HTTP clients: bodies the edge must refuse, bodies that never finish, headers that trickle.

Each returns an `Answer`: the status the server gave (None: none, the connection closed or the wait
ran out), its JSON error message, its headers and how long it took. Raw sockets are used where httpx
would finish a request that a hostile client leaves half-sent.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx


@dataclass(frozen=True)
class Answer:
    status: int | None
    message: str  # the error's message, the start of a body that is not one, or what happened
    seconds: float
    headers: dict[str, str] = field(default_factory=dict)
    json_error: bool = False  # the body was an OpenAI-style {"error": {"message": ...}}

    def describe(self) -> str:
        status = "no answer" if self.status is None else str(self.status)
        return f"{status} after {self.seconds:.2f} s: {self.message[:160]}"


def post_json_bytes(url: str, path: str, body: bytes, timeout_s: float = 60.0) -> Answer:
    """POSTs `body` as it is (it may be invalid JSON, or enormous) with a JSON content type."""
    started = time.perf_counter()
    try:
        response = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return Answer(None, f"transport: {type(exc).__name__}: {exc}", time.perf_counter() - started)
    return _answer(response.status_code, response.text, dict(response.headers), time.perf_counter() - started)


def post_json(url: str, path: str, body: object, timeout_s: float = 60.0) -> Answer:
    return post_json_bytes(url, path, json.dumps(body).encode(), timeout_s)


def _answer(status: int, text: str, headers: dict[str, str], seconds: float) -> Answer:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return Answer(status, text.strip()[:300], seconds, headers)
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return Answer(status, error["message"], seconds, headers, json_error=True)
    return Answer(status, text.strip()[:300], seconds, headers)


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=5.0)


def _read_answer(sock: socket.socket, started: float, wait_s: float) -> Answer:
    """What the server sends until it closes the connection or wait_s has passed."""
    sock.settimeout(0.2)
    received = b""
    deadline = started + wait_s
    while time.perf_counter() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError as exc:
            return Answer(None, f"reset: {exc}", time.perf_counter() - started)
        if not chunk:
            break
        received += chunk
    if not received:
        closed = time.perf_counter() < deadline
        return Answer(None, "closed without an answer" if closed else f"held open for {wait_s:.0f} s", time.perf_counter() - started)
    return _parse(received, time.perf_counter() - started)


def _parse(received: bytes, seconds: float) -> Answer:
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode(errors="replace").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return Answer(None, f"not HTTP: {received[:80]!r}", seconds)
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return _answer(status, body.decode(errors="replace"), headers, seconds)


def incomplete_body(url: str, path: str, declared: int, sent: bytes, wait_s: float) -> Answer:
    """Whole headers declaring a body of `declared` bytes, then only `sent`, then silence: the
    server must answer (408) and close within its body timeout."""
    started = time.perf_counter()
    with _connect(url) as sock:
        host = urlsplit(url).netloc
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n"
        )
        sock.sendall(head.encode() + sent)
        return _read_answer(sock, started, wait_s)


def slow_headers(url: str, path: str, wait_s: float, interval_s: float = 0.5) -> Answer:
    """Slowloris: a request line, then one byte of a header every interval_s, never the blank line
    that ends the headers. The answer says whether the server closed the connection within wait_s."""
    started = time.perf_counter()
    with _connect(url) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\n".encode())
        trickle = b"X-Slow: " + b"a" * 10_000
        sock.settimeout(interval_s)
        for byte in trickle:
            if time.perf_counter() - started > wait_s:
                return Answer(None, f"held open for {wait_s:.0f} s", time.perf_counter() - started)
            try:
                sock.sendall(bytes([byte]))
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError as exc:
                return Answer(None, f"closed: {exc}", time.perf_counter() - started)
            if not chunk:
                return Answer(None, "closed without an answer", time.perf_counter() - started)
            return _parse(chunk, time.perf_counter() - started)
        return _read_answer(sock, started, wait_s)
