"""Waker: the pipe another thread writes to end a socket's poll."""

from __future__ import annotations

import errno
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import zmq

import protocol.transport.waker as waker_module
from protocol.transport.waker import Waker

WAIT_S = 10.0


@contextmanager
def _waker(hold_gil: bool) -> Iterator[Waker]:
    context = zmq.Context()
    sock = context.socket(zmq.PAIR)
    sock.bind("inproc://waker-test")
    made = Waker(sock, hold_gil=hold_gil)
    try:
        yield made
    finally:
        made.close()
        sock.close(0)
        context.term()


@pytest.fixture(params=[True, False], ids=["holding-the-gil", "giving-it-up"])
def waker(request: pytest.FixtureRequest) -> Iterator[Waker]:
    with _waker(request.param) as made:
        yield made


def _poll_in_thread(waker: Waker, woke: threading.Event) -> threading.Thread:
    polling = threading.Event()

    def wait() -> None:
        polling.set()
        waker.poll(int(WAIT_S * 1000))
        woke.set()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    assert polling.wait(WAIT_S)
    return thread


def test_a_wake_ends_a_poll_on_another_thread(waker: Waker, monkeypatch: pytest.MonkeyPatch) -> None:
    written = []
    real = waker_module._WRITE
    if real is not None:
        monkeypatch.setattr(waker_module, "_WRITE", lambda *args: written.append(args) or real(*args))
    woke = threading.Event()
    thread = _poll_in_thread(waker, woke)
    try:
        time.sleep(0.01)  # most likely inside the poll by now; a wake that comes first ends it as well
        waker.wake()
        assert len(written) == (waker._hold_gil and real is not None)
        assert woke.wait(WAIT_S)
    finally:
        waker.wake()  # the thread ends before the fixture closes what it polls, whatever failed
        thread.join(WAIT_S)
    assert not thread.is_alive()


@pytest.mark.parametrize("hold_gil", [True, False], ids=["holding-the-gil", "giving-it-up"])
def test_a_wake_after_the_pipe_is_closed_is_an_error_either_way(hold_gil: bool) -> None:
    with _waker(hold_gil) as waker:
        waker.close()
        with pytest.raises(OSError) as raised:  # nothing opened since: the descriptor is not reused
            waker.wake()
        assert raised.value.errno == errno.EBADF
        waker._read, waker._write = os.pipe()  # for the context's own close


def _counted_across(waker: Waker, wake: Callable[[], Iterator[object]]) -> tuple[int, int]:
    """A thread that polls in 1 ms turns counts each turn; with it waiting for the GIL (and asking
    for it: the switch interval), this one holds the GIL for tens of milliseconds, calls `wake`'s
    calls, and reads the count again, all in C with no bytecode between them, so that only a call
    that gives the GIL up lets the other thread count. The count before and after."""
    counted: list[int] = []
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            waker.poll(1)
            counted.append(1)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    thread = threading.Thread(target=count, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while not counted:
            assert thread.is_alive() and time.monotonic() < deadline, "the counting thread did not start"
            time.sleep(0.001)
        seen = list(itertools.chain(map(len, [counted]), filter((-1).__eq__, range(5_000_000)), wake(), map(len, [counted])))
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        waker.wake()
        thread.join(WAIT_S)
    assert not thread.is_alive()
    return seen[0], seen[-1]


def test_a_wake_holding_the_gil_does_not_hand_it_to_a_thread_that_waits_for_it() -> None:
    # The executor's model thread wakes its link right before a forward, while the link may wait
    # for the GIL already: os.write gave it up there, and the link made and sent a RESULT while the
    # forward waited (docs/control_plane.md, change 113). The write a hold_gil Waker makes keeps it.
    # It is called here as wake() calls it (the test above holds wake() to it): wake() itself is
    # Python, whose first bytecode would give the GIL up to a thread that asks.
    if waker_module._WRITE is None:
        pytest.skip("libc's write cannot be loaded here")
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        pytest.skip("no GIL in this build")
    with _waker(hold_gil=True) as waker:
        before, after = _counted_across(waker, lambda: map(waker_module._WRITE, [waker._write], [b"w"], [1]))
        assert after == before
        # os.write hands it over, where the other thread asked for it in time (a loaded machine may
        # run it too late to ask: a few tries).
        handed = [_counted_across(waker, lambda: map(os.write, [waker._write], [b"w"])) for _ in range(5)]
    assert any(after > before for before, after in handed), handed


def test_wakes_nobody_reads_fill_the_pipe_without_an_error_and_end_the_next_poll_once(waker: Waker) -> None:
    for _ in range(100_000):  # more bytes than a pipe holds
        waker.wake()
    assert waker.poll(int(WAIT_S * 1000)) is False  # ended by the wake-ups, all of them read
    started = time.monotonic()
    assert waker.poll(20) is False  # nothing left: this one waits its time
    assert time.monotonic() - started >= 0.015  # ZeroMQ's clock may end a wait a little early


def test_an_executor_endpoint_is_woken_holding_the_gil_where_asked_and_the_scheduler_giving_it_up() -> None:
    from protocol.transport import ExecutorEndpoint, SchedulerEndpoint, ipc_address

    if waker_module._WRITE is None:
        pytest.skip("libc's write cannot be loaded here")
    key = b"k" * 32
    with SchedulerEndpoint(ipc_address(), key, "waker") as scheduler:
        assert not scheduler._waker._hold_gil
        for asked in (True, False):
            executor = ExecutorEndpoint(scheduler.address, key, "waker", 0, wake_holding_gil=asked)
            try:
                assert executor._waker._hold_gil is asked
            finally:
                executor.close()
