"""The socket options both endpoint kinds share, and the monitor events they watch."""

from __future__ import annotations

import zmq

# Long enough for a SHUTDOWN queued just before close() to leave, short enough that close() never
# hangs on a peer that went away.
LINGER_MS = 200

# zmq.POLLIN as a plain int, for testing a socket's EVENTS: `events & zmq.POLLIN` goes through
# the IntFlag's __rand__ and builds a flag member, twice the cost of the int test, several times a step.
POLLIN = int(zmq.POLLIN)

HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def new_socket(context: zmq.Context, kind: int) -> zmq.Socket:
    """A socket that queues frames for a slow peer rather than dropping them (no high-water mark)."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock
