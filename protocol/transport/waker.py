"""Ending a poll from another thread."""

from __future__ import annotations

import ctypes
import errno
import math
import os
import time
from collections.abc import Callable

import zmq

from protocol.transport.sockets import POLLIN


def _write_holding_the_gil() -> Callable[[int, bytes, int], int] | None:
    """libc's write(2) called with the GIL held (ctypes.PyDLL's calls keep it), or None where the
    C library cannot be loaded (Waker's hold_gil says where it is used)."""
    if os.name != "posix":
        return None
    try:
        # No argtypes: with them declared the call took ~28 us right after an idle against ~13
        # with ctypes' default conversions (an int, bytes, an int back), where os.write takes ~7.
        return ctypes.PyDLL(None, use_errno=True).write
    except (OSError, AttributeError, TypeError):
        return None


_WRITE = _write_holding_the_gil()


class Waker:
    """A pipe that a socket's poller watches beside the socket: a socket belongs to the one thread
    that polls it, and any other thread that has news for that one writes a byte here.

    `news`: other sockets of the same thread, each with the function that reads what came on it and
    says whether that ends the wait as a wake-up does (the scheduler's connection monitor: a rank's
    closed connection does, a stranger's does not).

    `hold_gil`: wake() keeps the GIL through its system call. os.write gives it up there, and a
    thread that waits for it takes it: an executor's link thread, woken for a step's answer right
    before the next forward, then made and sent the RESULT while the model's thread waited to start
    that forward (bench_step at 2 ranks with the GIL-holding forward, seven pairs: 848 us between
    two forwards against 268; docs/control_plane.md, change 113). Held, the link takes the GIL
    where the model's thread next gives it up, in the forward. Not the frontend's: its engine
    thread, woken by the HTTP thread, then waited for the GIL instead (20% more of its wake-ups
    a token at concurrency 32). The pipe is non-blocking, so the write that holds the GIL never
    waits."""

    def __init__(self, sock: zmq.Socket, news: dict[zmq.Socket, Callable[[], bool]] | None = None, hold_gil: bool = False) -> None:
        self._sock = sock
        self._hold_gil = hold_gil and _WRITE is not None
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._read, zmq.POLLIN)
        self._news = news or {}
        for other in self._news:
            self._poller.register(other, zmq.POLLIN)

    def wake(self) -> None:
        """Ends the poll's wait. A pipe full of wake-ups nobody has read yet holds one already:
        that is enough."""
        if self._hold_gil:
            # os.write retries an interrupted call (PEP 475); so does this.
            while _WRITE(self._write, b"w", 1) < 0 and (code := ctypes.get_errno()) != errno.EAGAIN:
                if code != errno.EINTR:
                    raise OSError(code, os.strerror(code))
            return
        try:
            os.write(self._write, b"w")
        except BlockingIOError:
            pass

    def poll(self, timeout_ms: int) -> bool:
        """Whether the socket has a message; False after timeout_ms (-1: for ever), a wake, or news
        that ends the wait."""
        if timeout_ms == 0:
            # Asked between frames, several times per step: the socket's own flags answer without
            # the poller, which gives up the GIL and may wait to take it back. A wake-up left in the
            # pipe ends the next wait instead, as wake() promises.
            return bool(self._sock.get(zmq.EVENTS) & POLLIN)
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        while True:
            ready = dict(self._poller.poll(None if deadline is None else max(0, timeout_ms)))
            if self._read in ready:
                try:
                    while os.read(self._read, 4096):
                        pass
                except BlockingIOError:
                    pass
            if self._sock in ready:
                return True
            # Every reader runs: what it reads is taken now, or the next wait would end at once.
            ends = [read() for other, read in self._news.items() if other in ready]
            if self._read in ready or not ends or any(ends):
                return False
            if deadline is not None:
                timeout_ms = math.ceil((deadline - time.monotonic()) * 1000)
                if timeout_ms <= 0:
                    return False

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)
