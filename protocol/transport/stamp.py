"""The envelope fields both endpoint kinds stamp on every frame they send, and the receive side's
authentication state (key, limits, replay guard)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from protocol.auth import ReplayGuard
from protocol.codec import Limits, encode, to_message
from protocol.frames import LAYOUT_VERSION, Body, Frame


def _first_seq() -> int:
    # seq only has to increase per sender; starting from the wall clock lets a restarted process
    # be accepted by a receiver that remembers its predecessor.
    return time.time_ns()


class Stamp:
    """Envelope fields shared by both endpoint kinds, and the receive-side authentication."""

    def __init__(self, key: bytes, run_id: str, supported_versions: Iterable[int], limits: Limits) -> None:
        self.key = key
        self.run_id = run_id
        self.version = max(supported_versions)
        self.layout = LAYOUT_VERSION
        self.limits = limits
        self.replay = ReplayGuard()
        self._seq = _first_seq()

    def encode(self, body: Body, step: int) -> bytes:
        """The next frame of this sender, as its one ZeroMQ message."""
        self._seq += 1
        frame = Frame(self.version, self.layout, self.run_id, step, self._seq, body)
        return to_message(encode(frame, self.key))
