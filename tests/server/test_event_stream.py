"""EventStream, the streamed answer's response, at the ASGI level: what it sends, and how a hang-up
or a cancel from the server ends it."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from tp_runtime.http.sse import EventStream, LastEvents


class Client:
    """An ASGI receive/send pair: `hang_up()` makes the next receive answer http.disconnect."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self._gone = asyncio.Event()

    def hang_up(self) -> None:
        self._gone.set()

    async def receive(self) -> dict:
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message["more_body"]:
            self.hang_up()  # as uvicorn: once the body has ended, receive() answers a disconnect

    def bodies(self) -> list[tuple[bytes, bool]]:
        return [(m["body"], m["more_body"]) for m in self.sent if m["type"] == "http.response.body"]


def run(events, client: Client) -> None:
    asyncio.run(EventStream(events)({"type": "http"}, client.receive, client.send))


def test_the_last_events_go_out_with_the_end_of_the_body():
    async def events():
        yield "data: 1\n\n"
        yield LastEvents("data: 2\n\ndata: [DONE]\n\n")

    client = Client()
    run(events(), client)
    start = client.sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert client.bodies() == [(b"data: 1\n\n", True), (b"data: 2\n\ndata: [DONE]\n\n", False)]


def test_what_the_events_do_after_their_last_text_is_not_cut():
    finished = []

    async def events():
        yield LastEvents("data: [DONE]\n\n")
        await asyncio.sleep(0.05)  # the other choices' pumps wind down
        finished.append(True)

    client = Client()
    run(events(), client)
    assert finished == [True]
    assert client.bodies() == [(b"data: [DONE]\n\n", False)]


def test_events_without_a_last_end_the_body_with_an_empty_write():
    async def events():
        yield "data: 1\n\n"

    client = Client()
    run(events(), client)
    assert client.bodies() == [(b"data: 1\n\n", True), (b"", False)]


def test_a_hang_up_while_no_event_comes_closes_the_events_and_ends_quietly():
    client, closed = Client(), []

    async def events():
        try:
            yield "data: 1\n\n"
            client.hang_up()
            await asyncio.Event().wait()  # the engine has nothing for this request for a long time
            yield "never"
        finally:
            closed.append(True)

    async def main() -> tuple[float, int]:
        started = time.monotonic()
        await EventStream(events())({"type": "http"}, client.receive, client.send)
        took = time.monotonic() - started
        # The stream's own task goes on, not cancelled: the server's clean-up after it runs.
        await asyncio.sleep(0)
        return took, asyncio.current_task().cancelling() if sys.version_info >= (3, 11) else 0

    took, cancelling = asyncio.run(asyncio.wait_for(main(), 30))
    assert took < 10 and cancelling == 0
    assert closed == [True]
    assert client.bodies() == [(b"data: 1\n\n", True)]


def test_a_cancel_by_the_server_goes_on_up_and_closes_the_events():
    closed = []

    async def events():
        try:
            yield "data: 1\n\n"
            await asyncio.Event().wait()
        finally:
            closed.append(True)

    async def main() -> None:
        task = asyncio.ensure_future(EventStream(events())({"type": "http"}, Client().receive, Client().send))
        await asyncio.sleep(0.01)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())
    assert closed == [True]


def test_a_failing_send_closes_the_events():
    closed = []

    async def events():
        try:
            yield "data: 1\n\n"
            yield "data: 2\n\n"
        finally:
            closed.append(True)

    async def broken_send(message: dict) -> None:
        if message["type"] == "http.response.body":
            raise OSError("connection reset")

    with pytest.raises(OSError):
        asyncio.run(EventStream(events())({"type": "http"}, Client().receive, broken_send))
    assert closed == [True]


def test_what_a_stopped_stream_failed_with_is_logged_not_left_unread(caplog: pytest.LogCaptureFixture):
    client = Client()

    async def events():
        try:
            yield "data: 1\n\n"
            client.hang_up()
            await asyncio.Event().wait()
        finally:
            raise RuntimeError("the engine could not be told")

    unread: list[dict] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: unread.append(context))
        await EventStream(events())({"type": "http"}, client.receive, client.send)

    with caplog.at_level("WARNING", logger="tp_runtime.http"):
        asyncio.run(main())
    assert "the engine could not be told" in caplog.text
    assert unread == []


class Refused(Exception):
    pass


def _streamed(events, client: Client | None = None, send_to: Client | None = None) -> tuple[Client, list[str]]:
    """The events through an EventStream whose failure callback answers Refused with its own last
    events; the client that got them, and what hung_up was told."""
    hung: list[str] = []
    client = client or Client()

    def failure(exc: Exception) -> str | None:
        return f"data: refused {exc}\n\n" if isinstance(exc, Refused) else None

    stream = EventStream(events, failure, lambda: hung.append("hung up"))
    asyncio.run(stream({"type": "http"}, client.receive, (send_to or client).send))
    return client, hung


def test_an_answered_failure_ends_the_body_with_its_events_and_is_no_hang_up():
    async def events():
        yield "data: 1\n\n"
        raise Refused("late")

    client, hung = _streamed(events())
    assert client.bodies() == [(b"data: 1\n\n", True), (b"data: refused late\n\n", False)]
    assert hung == []


def test_a_failure_not_answered_propagates_and_the_stream_counts_as_hung_up():
    hung_up: list[str] = []
    client = Client()

    async def events():
        yield "data: 1\n\n"
        raise KeyError("unexpected")

    def failure(exc: Exception) -> str | None:
        return None

    stream = EventStream(events(), failure, lambda: hung_up.append("hung up"))
    with pytest.raises(KeyError):
        asyncio.run(stream({"type": "http"}, client.receive, client.send))
    assert client.bodies() == [(b"data: 1\n\n", True)]
    assert hung_up == ["hung up"]


def test_a_hang_up_is_told_once_and_a_whole_body_never():
    client = Client()

    async def endless():
        yield "data: 1\n\n"
        client.hang_up()
        await asyncio.Event().wait()
        yield "never"

    _, hung = _streamed(endless(), client)
    assert hung == ["hung up"]

    async def whole():
        yield "data: 1\n\n"
        yield LastEvents("data: [DONE]\n\n")

    _, hung = _streamed(whole(), Client(), send_to=Client())
    assert hung == []
