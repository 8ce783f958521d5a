"""The per-launch frame key and replay protection.

On one host the frontend process makes the key (`new_key`) and hands it to rank 0 over a private
pipe; rank 0 broadcasts it to the other ranks over the torch.distributed group (tp_runtime/launch.py).
Across hosts the operator provisions it in a key directory instead (protocol.curve.load_keys). It
never travels on the frame sockets.
"""

from __future__ import annotations

import secrets

from protocol.errors import ProtocolError, RejectCode

KEY_BYTES = 32


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


class ReplayGuard:
    """Accepts a frame only if its seq is above the last accepted from the same sender."""

    def __init__(self) -> None:
        self._last: dict[str | int, int] = {}

    def check(self, sender: str | int, seq: int) -> None:
        last = self._last.get(sender)
        if last is not None and seq <= last:
            raise ProtocolError(
                RejectCode.REPLAY,
                f"seq {seq} from {sender!r} is not above {last}, the last one accepted from it",
            )
        self._last[sender] = seq

    def forget(self, sender: str | int) -> None:
        """Drop a sender's history (it left; a new process in its place starts a new count)."""
        self._last.pop(sender, None)
