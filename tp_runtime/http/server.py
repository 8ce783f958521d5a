"""The uvicorn server the frontend runs its app under: one definition, which the server and
scripts/bench_http.py share, so that the benchmark measures the protocol and loop that serve.
Imported only where a server is started (uvicorn, uvloop and httptools load with it)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

import uvicorn

from tp_runtime.http.header_deadline import protocol_with_header_timeout

if TYPE_CHECKING:
    from fastapi import FastAPI

TICK_S = 1.0  # the date header's resolution: uvicorn refreshes it every tenth tick of 0.1 s


class HttpServer(uvicorn.Server):
    """uvicorn's server, whose housekeeping loop wakes once a second instead of ten times, and at
    once when stop() is called from another thread.

    uvicorn's loop sleeps 0.1 s between ticks that refresh the date header (every tenth) and look
    at should_exit. An idle frontend spent ~2 ms of CPU a second on its HTTP thread, ~0.03 ms of
    each token at concurrency 1 (docs/control_plane.md); a stop no longer waits for a tick. Each
    tick waits on a plain future that a timer or stop() resolves: asyncio.wait_for ran the wait
    as a task of its own every tick (the idle HTTP thread 0.27-0.32 ms of CPU a second against
    0.37-0.39, docs/control_plane.md)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tick: asyncio.Future[None] | None = None

    async def main_loop(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        counter = 0
        while not await self.on_tick(counter):
            counter += 10  # on_tick refreshes the date header when counter % 10 == 0
            self._tick = tick = loop.create_future()
            timer = loop.call_later(TICK_S, _end_tick, tick)
            await tick
            timer.cancel()

    def stop(self) -> None:
        """End serving (uvicorn's graceful shutdown follows); any thread may call it."""
        self.should_exit = True
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: it ended already
                loop.call_soon_threadsafe(self._end_current_tick)

    def _end_current_tick(self) -> None:
        if self._tick is not None:
            _end_tick(self._tick)


def _end_tick(tick: asyncio.Future[None]) -> None:
    if not tick.done():
        tick.set_result(None)


def http_server(
    app: FastAPI, host: str, port: int, log_level: str, timeout_keep_alive: int, request_header_timeout: float
) -> HttpServer:
    return HttpServer(
        uvicorn.Config(
            app, host=host, port=port, log_level=log_level, lifespan="off",
            timeout_keep_alive=timeout_keep_alive,
            http=protocol_with_header_timeout(request_header_timeout),
            # uvloop, not asyncio's own loop: the engine thread hands each step's tokens over with
            # call_soon_threadsafe, and every streamed token is a transport write; both run in C
            # there (served at concurrency 1, this process's CPU per token 1.60 against 1.70 ms,
            # the HTTP thread's ~370 against ~500 us: docs/control_plane.md).
            loop="uvloop",
        )
    )
