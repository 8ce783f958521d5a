"""The routes that make the model generate, answered beneath the app's own middleware alone.

Under FastAPI a request passes a dozen ASGI layers before its endpoint (Starlette's error and
exception middleware, FastAPI's telemetry, body limit and exit stack, the router trying each route
in turn, the route's request/response wrapper), and every message its answer sends goes back up
through three of them. The generating routes need none of that: their endpoints read and answer
their bodies themselves, raise nothing but ApiError, and stream through EventStream. At concurrency
32 a request of 64 tokens costs the HTTP thread more than its streaming does (docs/control_plane.md,
the twentieth sitting), so RuntimeApp hands a POST to one of these paths to the same middleware the
app adds (built from one list, app.py) around `Endpoints`, which answers an ApiError as the app's
handler does; any other request, and one with a root_path to strip, goes through FastAPI as before.
An unexpected exception propagates to uvicorn, which logs it and answers 500 if nothing was sent,
as Starlette's ServerErrorMiddleware would.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tp_runtime.http.errors import ApiError

Endpoint = Callable[[Request], Awaitable[Response]]


class Endpoints:
    """The innermost layer of the direct lane: the endpoint of the request's path, its ApiError
    answered by `answer_error` (errors.answer_error, the app's own handler)."""

    def __init__(self, endpoints: Mapping[str, Endpoint], answer_error: Callable[[ApiError], Response]):
        self._endpoints = dict(endpoints)
        self._answer_error = answer_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            response = await self._endpoints[scope["path"]](Request(scope, receive, send))
        except ApiError as exc:
            response = self._answer_error(exc)
        await response(scope, receive, send)


class RuntimeApp(FastAPI):
    """FastAPI, with the generating routes' POSTs taken by `direct` (set by create_app: the app's
    middleware around Endpoints) and `direct_paths` before FastAPI's own layers."""

    direct: ASGIApp | None = None
    direct_paths: frozenset[str] = frozenset()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.direct is not None and scope["type"] == "http" and scope["method"] == "POST"
            and scope["path"] in self.direct_paths and not scope.get("root_path")
        ):  # fmt: skip
            scope["app"] = self
            await self.direct(scope, receive, send)
            return
        await super().__call__(scope, receive, send)
