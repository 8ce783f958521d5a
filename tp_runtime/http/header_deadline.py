"""uvicorn's httptools protocol with a deadline on the request head.

uvicorn times out an idle keep-alive connection but neither a request line nor headers that never
end: a client that trickles one header byte at a time (slowloris) holds its connection, and with
enough of them the server's sockets, for as long as it likes; and any byte it sends cancels the
keep-alive timer. Here each request's head (request line and headers) must be complete within
`--request-header-timeout` seconds of the connection opening or of the previous response ending,
else the connection is closed. Nothing can be answered first: HTTP gives a server no response
before it has a request. The body has its own deadline (middleware.BodyLimits).

A head is also bounded in size: h11 refused one over 16 KiB, and neither llhttp nor uvicorn's
httptools protocol has any bound (a client could buffer gigabytes in one header line within the
deadline, or without one while a response streams on its connection). A head that passes
`max_head_bytes` is answered 431 and the connection closed.

httptools (llhttp, in C) rather than uvicorn's h11 protocol, as vLLM's server runs: h11's state
machine was ~20 Python calls of every streamed chunk (scripts/bench_http.py: 131 against 108 calls
per token, docs/control_plane.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tp_runtime.http.errors import ApiError

log = logging.getLogger("tp_runtime.http")

MAX_HEAD_BYTES = 16 * 1024  # h11's bound, which uvicorn's h11 protocol applied


class HeaderDeadlineProtocol(HttpToolsProtocol):
    header_timeout_s = 10.0
    max_head_bytes = MAX_HEAD_BYTES

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._in_head = False  # a request head has begun and is not complete
        self._head_bytes = 0
        self._head_restarted = False  # a head began during the chunk being parsed
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        whole_chunk_in_head = self._in_head
        super().data_received(data)
        # Counted only for a chunk that a head held from its start to its end: a head that begins
        # inside a chunk (after a body, say) goes uncounted for that one chunk, never overcounted.
        if whole_chunk_in_head and self._in_head and not self._head_restarted:
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
                self._refuse_head()
        self._head_restarted = False

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._head_restarted = True, 0, True

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_deadline()
        super().on_headers_complete()

    def _refuse_head(self) -> None:
        log.info("closed %s: its request head passed %d bytes", self.client, self.max_head_bytes)
        self._answer_and_close(ApiError(
            431,
            f"the request line and headers are over {self.max_head_bytes} bytes, the most this server reads",
            type="invalid_request_error",
            code="request_header_fields_too_large",
        ))  # fmt: skip

    def send_400_response(self, msg: str) -> None:
        """What the parser refused (a malformed request line or header), in the API's JSON error
        shape like every other refusal, rather than uvicorn's plain text."""
        message = f"the request is not well-formed HTTP/1.1 ({msg.rstrip('.')})"
        self._answer_and_close(ApiError(400, message, type="invalid_request_error", code="malformed_http"))

    def _answer_and_close(self, error: ApiError) -> None:
        # A pipelined head can be refused while the response before it streams: that response must
        # not be cut by another's bytes, so the connection only closes.
        if self.cycle is None or self.cycle.response_complete:
            body = json.dumps(error.body()).encode()
            head = (
                f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            )
            self.transport.write(head.encode() + body)
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request whose head came during the response is served now: no head is awaited.
        if not self.transport.is_closing() and self.cycle.response_complete:
            self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_too_slow)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            if self._in_head:  # part of a head: a slow or hostile client, not an idle one
                log.info("closed %s: its request head did not arrive within %g s", self.client, self.header_timeout_s)
            self.transport.close()


def protocol_with_header_timeout(timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class uvicorn.Config(http=...) takes, with this deadline."""
    if not timeout_s > 0:
        raise ValueError(f"the request header timeout must be positive, got {timeout_s}")
    return type("HeaderDeadline", (HeaderDeadlineProtocol,), {"header_timeout_s": float(timeout_s)})
