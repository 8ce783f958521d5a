"""The uvicorn server the frontend runs its app under: one definition, which the server and
scripts/bench_http.py share, so that the benchmark measures the protocol and loop that serve."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tp_runtime.http.header_deadline import protocol_with_header_timeout

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI


def uvicorn_config(
    app: FastAPI, host: str, port: int, log_level: str, timeout_keep_alive: int, request_header_timeout: float
) -> uvicorn.Config:
    import uvicorn

    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="off",
        timeout_keep_alive=timeout_keep_alive,
        http=protocol_with_header_timeout(request_header_timeout),
        # uvloop, not asyncio's own loop: the engine thread hands each step's tokens over with
        # call_soon_threadsafe, and every streamed token is a transport write; both run in C
        # there (served at concurrency 1, this process's CPU per token 1.60 against 1.70 ms,
        # the HTTP thread's ~370 against ~500 us: docs/control_plane.md).
        loop="uvloop",
    )
