"""The ASGI layers around the routes, outermost first: count every answer, check the Host header,
check the API key, bound the body. Each answers a refusal itself, as JSON in the API's error shape,
before any route (or body parsing) runs.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would buffer streamed answers.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tp_runtime.http.errors import ApiError


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


class RequestCounter:
    """Counts answered requests by route and status."""

    def __init__(self, app: ASGIApp, count: Callable[[str, int], None], routes: frozenset[str]):
        self._app = app
        self._count = count
        self._routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self._routes else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._count(endpoint, message["status"])
            await send(message)

        await self._app(scope, receive, counting_send)


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, without its port: "[::1]:8000" -> "::1"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    name, _, port = header.rpartition(":")
    return name if name and port.isdigit() else header


class HostCheck:
    """Against DNS rebinding: a server bound to loopback answers only requests addressed to a
    loopback name. A web page whose own name an attacker points at 127.0.0.1 sends its name in
    Host, which this refuses (421) before anything else runs. A request without Host (HTTP/1.0,
    not a browser) passes."""

    def __init__(self, app: ASGIApp):
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = _header(scope, b"host")
            if header is not None and not is_loopback(host_name(header.decode("latin-1"))):
                error = ApiError(
                    421,
                    "this server listens on a loopback address and answers only requests to localhost, "
                    "127.0.0.1 or [::1]",
                    type="invalid_request_error",
                    code="invalid_host",
                )
                await error.send(send, close=True)
                return
        await self._app(scope, receive, send)


class OriginCheck:
    """A web page must not be able to make the server generate. A browser sends some cross-site
    POSTs without asking first (a "simple request": no Content-Type, text/plain, a form), and
    /generate takes any content type on purpose; every such request carries the page's Origin. A
    route that generates therefore refuses (403) a request whose Origin is not this server's own
    (the scheme-less host:port of its Host header); curl and the OpenAI clients send no Origin and
    pass."""

    def __init__(self, app: ASGIApp, paths: frozenset[str]):
        self._app = app
        self._paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path", "") in self._paths:
            origin = _header(scope, b"origin")
            if origin is not None and not _same_origin(origin, _header(scope, b"host")):
                error = ApiError(
                    403,
                    f"requests from the web page at {origin.decode('latin-1')!r} may not generate here: this server "
                    "answers such requests only without an Origin header (as curl and API clients send them)",
                    type="invalid_request_error",
                    code="foreign_origin",
                )
                await error.send(send, close=True)
                return
        await self._app(scope, receive, send)


def _same_origin(origin: bytes, host: bytes | None) -> bool:
    """Whether an Origin ("http://host:port", or "null") names the server the request was sent to."""
    text = origin.decode("latin-1").strip().lower()
    scheme, sep, authority = text.partition("://")
    if not sep or scheme not in ("http", "https") or host is None:
        return False
    return authority.rstrip("/") == host.decode("latin-1").strip().lower()


class ApiKeyAuth:
    """Bearer-token auth (`Authorization: Bearer <key>`) on the API routes: every /v1 path, /generate,
    /tokenize and /detokenize, and /metrics when `protect_metrics`; /health, /ping and /version stay
    open for probes."""

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool):
        self._app = app
        self._key = api_key.encode()
        self._protect_metrics = protect_metrics

    def protects(self, path: str) -> bool:
        return (
            path.startswith("/v1")
            or path in ("/generate", "/tokenize", "/detokenize")
            or (self._protect_metrics and path == "/metrics")
        )

    def _authorized(self, scope: Scope) -> bool:
        header = _header(scope, b"authorization") or b""
        scheme, _, token = header.partition(b" ")
        # compare_digest takes as long whatever the bytes: the key cannot be guessed by timing.
        return hmac.compare_digest(token.strip(), self._key) and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.protects(scope.get("path", "")) and not self._authorized(scope):
            error = ApiError(
                401,
                "this server needs an API key: send the header 'Authorization: Bearer <key>'",
                type="invalid_request_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error.send(send, close=True)
            return
        await self._app(scope, receive, send)


class BodyLimits:
    """Reads each request body whole before the route sees it, refusing one over `max_bytes` (413,
    from its Content-Length at once, or counted as a chunked body arrives) and one that does not
    arrive within `timeout_s` (408). Both answers close the connection, so a client that sends half
    a body and stalls holds its connection for `timeout_s` at most. Nothing is parsed before this
    has passed."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float):
        self._app = app
        self._max = max_bytes
        self._timeout_s = timeout_s

    def _too_large(self, size: str) -> ApiError:
        return ApiError(
            413,
            f"the request body is {size}; this server takes up to {self._max} bytes (--max-request-body-size)",
            type="invalid_request_error",
            code="request_body_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max:
            await self._too_large(f"{int(declared)} bytes").send(send, close=True)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:  # TimeoutError itself only from Python 3.11
                error = ApiError(
                    408,
                    f"the request body did not arrive within {self._timeout_s:g} s (--request-body-timeout)",
                    type="invalid_request_error",
                    code="request_timeout",
                )
                await error.send(send, close=True)
                return
            if message["type"] == "http.disconnect":
                return  # the client left before its body was whole: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._max:
                await self._too_large(f"over {self._max} bytes").send(send, close=True)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self._app(scope, _replay(b"".join(chunks), receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body read already, then the connection's own messages (a
    disconnect, which the routes watch for)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay
