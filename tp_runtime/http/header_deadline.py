"""uvicorn's httptools protocol with a deadline on the request head.

uvicorn times out an idle keep-alive connection but neither a request line nor headers that never
end: a client that trickles one header byte at a time (slowloris) holds its connection, and with
enough of them the server's sockets, for as long as it likes; and any byte it sends cancels the
keep-alive timer. Here each request's head (request line and headers) must be complete within
`--request-header-timeout` seconds of the connection opening or of the previous response ending,
else the connection is closed. Nothing can be answered first: HTTP gives a server no response
before it has a request. The body has its own deadline (middleware.BodyLimits).

httptools (llhttp, in C) rather than uvicorn's h11 protocol, as vLLM's server runs: h11's state
machine was ~20 Python calls of every streamed chunk (scripts/bench_http.py: 131 against 108 calls
per token, docs/control_plane.md).
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("tp_runtime.http")


class HeaderDeadlineProtocol(HttpToolsProtocol):
    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._head_begun = False
        self._arm_head_deadline()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_begun = True

    def on_headers_complete(self) -> None:
        self._cancel_head_deadline()
        super().on_headers_complete()

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
        self._head_begun = False
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_too_slow)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            if self._head_begun:  # part of a head: a slow or hostile client, not an idle one
                log.info("closed %s: its request head did not arrive within %g s", self.client, self.header_timeout_s)
            self.transport.close()


def protocol_with_header_timeout(timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class uvicorn.Config(http=...) takes, with this deadline."""
    if not timeout_s > 0:
        raise ValueError(f"the request header timeout must be positive, got {timeout_s}")
    return type("HeaderDeadline", (HeaderDeadlineProtocol,), {"header_timeout_s": float(timeout_s)})
