"""Ending a poll from another thread."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import zmq

from protocol.transport.sockets import POLLIN


class Waker:
    """A pipe that a socket's poller watches beside the socket: a socket belongs to the one thread
    that polls it, and any other thread that has news for that one writes a byte here.

    `news`: other sockets of the same thread, each with the function that reads what came on it and
    says whether that ends the wait as a wake-up does (the scheduler's connection monitor: a rank's
    closed connection does, a stranger's does not)."""

    def __init__(self, sock: zmq.Socket, news: dict[zmq.Socket, Callable[[], bool]] | None = None) -> None:
        self._sock = sock
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
        try:
            os.write(self._write, b"w")
        except BlockingIOError:  # the pipe is full of wake-ups nobody has read yet: one is enough
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
