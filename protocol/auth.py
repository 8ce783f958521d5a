"""The per-launch frame key and replay protection.

The key is made by the launcher and reaches the other processes out of band (a 0600 file or an
inherited environment variable), never over the frame sockets.
"""

from __future__ import annotations

import os
import secrets

from protocol.errors import ProtocolError, RejectCode

KEY_BYTES = 32
KEY_FILE_NAME = "frame.key"
# The launcher may hand the key path to its children in this variable.
KEY_FILE_ENV = "TP_RUNTIME_KEY_FILE"


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def write_key_file(directory: str) -> str:
    """Write a fresh key into `directory` as a file only its owner can read; return its path."""
    path = os.path.join(directory, KEY_FILE_NAME)
    # O_EXCL: never reuse (or follow a planted link to) a file someone else made.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, new_key())
    finally:
        os.close(fd)
    return path


def read_key_file(path: str) -> bytes:
    """Read a key file, refusing one that others can read or whose size is not a key's."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            key = f.read(KEY_BYTES + 1)
    except OSError as exc:
        raise ProtocolError(RejectCode.INTERNAL, f"cannot read the frame key file {path}: {exc}") from exc
    if mode & 0o077:
        raise ProtocolError(
            RejectCode.INTERNAL,
            f"the frame key file {path} has mode {mode & 0o777:o}; it must be 0600",
        )
    if len(key) != KEY_BYTES:
        raise ProtocolError(
            RejectCode.INTERNAL, f"the frame key file {path} must hold exactly {KEY_BYTES} bytes"
        )
    return key


def key_from_environment() -> bytes:
    """The key whose file the launcher named in TP_RUNTIME_KEY_FILE."""
    path = os.environ.get(KEY_FILE_ENV)
    if not path:
        raise ProtocolError(
            RejectCode.INTERNAL, f"{KEY_FILE_ENV} is not set: the launcher did not pass a frame key"
        )
    return read_key_file(path)


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
