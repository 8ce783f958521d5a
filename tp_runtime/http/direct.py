"""The routes that make the model generate, answered beneath the app's own middleware alone.

Under FastAPI a request passes a dozen ASGI layers before its endpoint (Starlette's error and
exception middleware, FastAPI's telemetry, body limit and exit stack, the router trying each route
in turn, the route's request/response wrapper), and every message its answer sends goes back up
through three of them. The generating routes need none of that: their endpoints read and answer
their bodies themselves, answer every refusal as an ApiError, and stream through EventStream. At
concurrency 32 a request of 64 tokens costs the HTTP thread about as much as its streaming
(docs/control_plane.md, the twentieth sitting), so RuntimeApp hands a POST to one of these paths
to the app's own middleware (the list add_middleware built) around `Endpoints`, which answers an
ApiError with the app's own handler; any other request, and one with a root_path to strip, goes
through FastAPI as before. An unexpected exception propagates to uvicorn, which logs it and answers
500 if nothing was sent, as Starlette's ServerErrorMiddleware would. Where the app wants what the
skipped layers do (FastAPI's OpenTelemetry or body limit switched on, OpenTelemetry's own
instrumentation, a handler for 500), every request takes them.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tp_runtime.http.errors import ApiError

Endpoint = Callable[[Request], Awaitable[Response]]
ErrorHandler = Callable[[Request, ApiError], Awaitable[Response]]


class Endpoints:
    """The innermost layer of the direct lane: the endpoint of the request's path, an ApiError it
    raises answered by the app's handler for its class or the nearest base (as Starlette's
    ExceptionMiddleware looks them up), async or not."""

    def __init__(self, endpoints: Mapping[str, Endpoint], handlers: Mapping[object, ErrorHandler]):
        self._endpoints = dict(endpoints)
        self._handlers = dict(handlers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await self._endpoints[scope["path"]](request)
        except ApiError as exc:
            handler = next(self._handlers[cls] for cls in type(exc).__mro__ if cls in self._handlers)
            if inspect.iscoroutinefunction(handler):
                response = await handler(request, exc)
            else:
                response = await run_in_threadpool(handler, request, exc)
        await response(scope, receive, send)


class RuntimeApp(FastAPI):
    """FastAPI, with the POSTs of the routes given to add_direct_routes taken by the direct lane.
    The lane is built at the first such request, from the middleware and handlers the app has by
    then. `direct_lane = False` sends every request through FastAPI (tests compare the two)."""

    direct_lane = True

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self._direct: dict[str, Endpoint] = {}
        self._lane: ASGIApp | None = None

    def add_direct_routes(self, endpoints: Mapping[str, Endpoint]) -> None:
        """POST routes, registered with the router too: listed there, another method or a trailing
        slash answered as for any route."""
        for path, endpoint in endpoints.items():
            self.router.add_route(path, endpoint, methods=["POST"])
        self._direct.update(endpoints)
        self._lane = None

    def add_middleware(self, *args: object, **options: object) -> None:
        super().add_middleware(*args, **options)
        self._lane = None  # built again, around it too

    def add_exception_handler(self, *args: object, **options: object) -> None:
        super().add_exception_handler(*args, **options)
        self._lane = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self._direct
            and not scope.get("root_path") and self.direct_lane
        ):  # fmt: skip
            lane = self._lane if self._lane is not None else self._build_lane()
            if lane is not self:
                scope["app"] = self
                await lane(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def _build_lane(self) -> ASGIApp:
        """The app's middleware around Endpoints; the app itself where the lane must not be taken:
        FastAPI's own OpenTelemetry or body limit switched on, opentelemetry-instrumentation's
        middleware (it replaces build_middleware_stack on the instance), a handler for 500, or
        none for ApiError."""
        telemetry = getattr(self, "_native_telemetry", None)  # FastAPI's OpenTelemetry, from 0.16x
        handlers = self.exception_handlers
        if (
            ApiError not in handlers or 500 in handlers or Exception in handlers
            or (telemetry is not None and telemetry.enabled())
            or getattr(self, "max_body_size", None) is not None
            or "build_middleware_stack" in vars(self)
        ):  # fmt: skip
            self._lane = self
            return self
        lane: ASGIApp = Endpoints(self._direct, handlers)
        for middleware in reversed(self.user_middleware):  # the first one added runs last
            lane = middleware.cls(lane, *middleware.args, **middleware.kwargs)
        self._lane = lane
        return lane
