"""Server-sent events: the framing of every streamed answer, and the response that sends them."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncGenerator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("tp_runtime.http")

SSE_MEDIA_TYPE = "text/event-stream"
DONE = "[DONE]"

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def sse(data: str, event: str | None = None) -> str:
    """One server-sent event; a multi-line payload becomes several data lines, as SSE requires
    (a reader joins them with "\\n", so a bare "\\r" in the text arrives as "\\n")."""
    head = f"event: {event}\n" if event else ""
    if "\n" not in data and "\r" not in data:  # every JSON payload: a JSON text escapes its line breaks
        return f"{head}data: {data}\n\n"
    return head + "".join(f"data: {line}\n" for line in _LINE_BREAK.split(data)) + "\n"


class LastEvents(str):
    """A stream's last text: it goes out with the end of the body, in one write."""


class EventStream(Response):
    """Streams the text of `events` as server-sent events, and stops it when the client hangs up.

    The events are sent from a task of their own, so that each piece resumes only their few
    generators, not the coroutines of the ASGI stack above this response (every middleware awaits
    the one below it): the request's task sleeps until the stream ends or the client hangs up.
    Starlette's StreamingResponse streams from the request's task and watches for the hang-up
    from an anyio task group. A hang-up cancels the sending task, which unwinds the event
    generators (their finally blocks tell the engine). The last events carry the end of the body
    in their write, where StreamingResponse writes it apart.

    `failure(exc)`: the last events that answer an exception the events raised once the stream
    has started (None: it propagates); `hung_up()`: called when the stream ends without its body
    ended (the client left, or the server stops). Here rather than in a generator around the
    events, which every piece would resume."""

    media_type = SSE_MEDIA_TYPE

    def __init__(
        self,
        events: AsyncGenerator[str, None],
        failure: Callable[[Exception], str | None] = lambda exc: None,
        hung_up: Callable[[], None] = lambda: None,
    ):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._failure = failure
        self._hung_up = hung_up
        self._body_ended = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self._send_events(send))
        watcher = asyncio.ensure_future(_disconnect(receive))
        try:
            await asyncio.wait((sender, watcher), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server stops: so does the stream
            await _stopped(sender, watcher)
            raise
        # Once the body has ended the server answers receive() with a disconnect: what the events
        # still do then (n choices' other pumps) is not a hang-up, and is waited for.
        if not sender.done() and not self._body_ended:
            await _stopped(sender, watcher)
            return
        await _stopped(watcher)
        await sender

    async def _send_events(self, send: Send) -> None:
        events = self.events
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            while True:
                try:
                    text = await events.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as exc:  # the events' own failure; a failed send propagates
                    text = self._failure(exc)
                    if text is None:
                        raise
                    self._body_ended = True
                    await send({"type": "http.response.body", "body": text.encode(), "more_body": False})
                    break
                self._body_ended = isinstance(text, LastEvents)
                await send({"type": "http.response.body", "body": text.encode(), "more_body": not self._body_ended})
            if not self._body_ended:
                self._body_ended = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            try:
                await events.aclose()
            finally:
                if not self._body_ended:
                    self._hung_up()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _stopped(*tasks: asyncio.Task) -> None:
    """Cancels the tasks and waits for them to unwind; what one failed with is logged, never left
    unread (asyncio would print it when the task is collected)."""
    for task in tasks:
        task.cancel()
    for outcome in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(outcome, Exception):
            log.warning("a stream failed as it stopped: %r", outcome)
