"""Ending a poll from another thread."""

from __future__ import annotations

import os

import zmq

from protocol.transport.sockets import POLLIN


class Waker:
    """A pipe that a socket's poller watches beside the socket: a socket belongs to the one thread
    that polls it, and any other thread that has news for that one writes a byte here."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._read, zmq.POLLIN)

    def wake(self) -> None:
        try:
            os.write(self._write, b"w")
        except BlockingIOError:  # the pipe is full of wake-ups nobody has read yet: one is enough
            pass

    def poll(self, timeout_ms: int) -> bool:
        """Whether the socket has a message; False after timeout_ms (-1: for ever) or a wake."""
        if timeout_ms == 0:
            # Asked between frames, several times per step: the socket's own flags answer without
            # the poller, which gives up the GIL and may wait to take it back. A wake-up left in the
            # pipe ends the next wait instead, as wake() promises.
            return bool(self._sock.get(zmq.EVENTS) & POLLIN)
        ready = dict(self._poller.poll(None if timeout_ms < 0 else timeout_ms))
        if self._read in ready:
            try:
                while os.read(self._read, 4096):
                    pass
            except BlockingIOError:
                pass
        return self._sock in ready

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)
