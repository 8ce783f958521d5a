"""The frontend's uvicorn server (tp_runtime.http.server.HttpServer): a housekeeping loop that
wakes once a second, and a stop that does not wait for it."""

from __future__ import annotations

import json
import socket
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


def _http_chunks(port: int, path: str, body: dict) -> list[bytes]:
    """The response body's HTTP chunks as they came on the wire (chunked encoding, undecoded):
    each is one write of the server's."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload
        )
        raw = b""
        while block := sock.recv(65536):
            raw += block
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] and b"transfer-encoding: chunked" in head.lower()
    chunks = []
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        chunks.append(rest[:n])
        rest = rest[n + 2 :]
    assert chunks[-1] == b""  # the terminating chunk
    return chunks[:-1]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_writes_each_piece_once_with_the_opening_and_the_closing(live_server, path: str) -> None:
    """One write per piece of output: the chat opening (the role) goes with the first piece, the
    usage and [DONE] with the last, and no write carries half an event."""
    body = {"model": MODEL_NAME, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "one two three four"}]
    else:
        body["prompt"] = "one two three four"
    port = int(live_server.base_url.rsplit(":", 1)[1])
    chunks = _http_chunks(port, path, body)
    events = [chunk.split(b"\n\n")[:-1] for chunk in chunks]
    assert all(chunk.endswith(b"\n\n") for chunk in chunks)
    assert 2 <= len(chunks) <= 6  # at most one write per token (a token may add no text yet)
    decoded = [[json.loads(e.removeprefix(b"data: ")) for e in write if e != b"data: [DONE]"] for write in events]
    first, middle, last = decoded[0], decoded[1:-1], decoded[-1]
    if path.endswith("chat/completions"):
        assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert len(first) == 2 and first[1]["choices"][0]["delta"]["content"]
    else:
        assert len(first) == 1 and first[0]["choices"][0]["text"]
    assert all(len(write) == 1 and write[0]["choices"][0]["finish_reason"] is None for write in middle)
    assert events[-1][-1] == b"data: [DONE]" and all(b"[DONE]" not in chunk for chunk in chunks[:-1])
    assert last[-1]["usage"]["completion_tokens"] == 6 and not last[-1]["choices"]
    assert last[-2]["choices"][0]["finish_reason"] == "length"
