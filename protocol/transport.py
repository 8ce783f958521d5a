"""A thin pyzmq shell around the codec: the scheduler's ROUTER and each executor's DEALER.

Delivery is reliable: ROUTER_MANDATORY makes a send to a peer that is not connected raise instead of
vanishing, and unlimited high-water marks mean a slow peer queues frames rather than losing them.
Both ends stamp version, layout, run id and seq on send and run the codec's MAC check, the envelope
check and the replay guard on receive.

Version negotiation: an endpoint starts at the highest version it supports. HELLO and WELCOME are
accepted at any version in `supported_versions` (their purpose is to agree on one); every other
frame must carry exactly `endpoint.version`, which the owner sets to WELCOME's version.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol.auth import ReplayGuard
from protocol.codec import DEFAULT_LIMITS, Limits, decode, encode
from protocol.errors import ProtocolError, RejectCode, TransportError
from protocol.frames import LAYOUT_VERSION, SUPPORTED_VERSIONS, Body, Frame, FrameType
from protocol.validate import check_envelope

# Long enough for a SHUTDOWN queued just before close() to leave, short enough that close() never
# hangs on a peer that went away.
LINGER_MS = 200
_IDENTITY_PREFIX = b"rank-"
_SCHEDULER = "scheduler"
_HANDSHAKE = (FrameType.HELLO, FrameType.WELCOME)

# ipc directories made by ipc_address(), removed by the endpoint that binds there when it closes.
_PRIVATE_DIRS: set[str] = set()


def ipc_address(tag: str = "sched") -> str:
    """An ipc:// address inside a fresh directory only this user can enter (mode 0700)."""
    if not tag.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"ipc tag {tag!r} must be letters, digits, '-' or '_'")
    directory = tempfile.mkdtemp(prefix="tp-runtime-")
    os.chmod(directory, 0o700)
    _PRIVATE_DIRS.add(directory)
    return f"ipc://{directory}/{tag}.sock"


def identity_of(rank: int) -> bytes:
    return _IDENTITY_PREFIX + str(rank).encode()


def _rank_of(identity: bytes) -> int | None:
    digits = identity[len(_IDENTITY_PREFIX) :]
    if not identity.startswith(_IDENTITY_PREFIX) or not digits.isdigit() or len(digits) > 9:
        return None
    return int(digits)


def _first_seq() -> int:
    # seq only has to increase per sender; starting from the wall clock lets a restarted process
    # with the same identity be accepted by a receiver that remembers its predecessor.
    return time.time_ns()


class _Stamp:
    """Envelope fields shared by both endpoint kinds, and the receive-side checks."""

    def __init__(self, key: bytes, run_id: str, supported_versions: Iterable[int], limits: Limits) -> None:
        self.key = key
        self.run_id = run_id
        self.supported_versions = tuple(supported_versions)
        self.version = max(self.supported_versions)
        self.layout = LAYOUT_VERSION
        self.limits = limits
        self.replay = ReplayGuard()
        self._seq = _first_seq()

    def encode(self, body: Body, step: int) -> list[bytes]:
        self._seq += 1
        frame = Frame(self.version, self.layout, self.run_id, step, self._seq, body)
        return encode(frame, self.key)

    def decode(self, parts: list[zmq.Frame], sender: str | int) -> Frame:
        frame = decode(parts, self.key, self.limits)
        if frame.type in _HANDSHAKE:
            if frame.version not in self.supported_versions:
                raise ProtocolError(
                    RejectCode.BAD_VERSION,
                    f"{frame.type.name} has protocol version {frame.version}; this peer supports "
                    f"{list(self.supported_versions)}",
                )
            check_envelope(frame, version=frame.version, layout=self.layout, run_id=self.run_id)
        else:
            check_envelope(frame, version=self.version, layout=self.layout, run_id=self.run_id)
        self.replay.check(sender, frame.seq)
        return frame


def _socket(context: zmq.Context, kind: int) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


@dataclass(frozen=True)
class Received:
    """One frame from a peer, or why it was refused (`rank` is -1 for an unknown identity)."""

    rank: int
    frame: Frame | None
    error: ProtocolError | None


class SchedulerEndpoint:
    """The scheduler's side: binds, talks to every rank by its identity."""

    def __init__(
        self,
        address: str,
        key: bytes,
        run_id: str,
        *,
        supported_versions: Iterable[int] = SUPPORTED_VERSIONS,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self._stamp = _Stamp(key, run_id, supported_versions, limits)
        self._context = zmq.Context()
        self._sock = _socket(self._context, zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self._sock.bind(address)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._context.term()
            raise TransportError(f"cannot bind the scheduler endpoint to {address}: {exc}") from exc
        self.address: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        # A rank whose process dies closes its connection at once; watching for that notices a
        # death mid-step, when the rank cannot heartbeat.
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._closed = False

    def disconnected(self) -> bool:
        """True if a rank's connection closed since the last call (a peer process ended)."""
        seen = False
        while self._monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(self._monitor)
            seen = seen or event["event"] == zmq.EVENT_DISCONNECTED
        return seen

    @property
    def version(self) -> int:
        return self._stamp.version

    @version.setter
    def version(self, value: int) -> None:
        self._stamp.version = value

    def send(self, rank: int, body: Body, step: int) -> None:
        self._send_parts((rank,), self._stamp.encode(body, step))

    def send_all(self, ranks: Iterable[int], body: Body, step: int) -> None:
        """Encode once, send the same parts to every rank."""
        self._send_parts(ranks, self._stamp.encode(body, step))

    def _send_parts(self, ranks: Iterable[int], parts: list[bytes]) -> None:
        for rank in ranks:
            try:
                self._sock.send_multipart([identity_of(rank), *parts])
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    raise TransportError(f"rank {rank} is not connected to {self.address}") from exc
                raise TransportError(f"cannot send to rank {rank}: {exc}") from exc

    def recv(self, timeout_ms: int) -> Received | None:
        """The next frame from any rank, or None after timeout_ms (-1: wait for ever)."""
        if not self._sock.poll(timeout_ms, zmq.POLLIN):
            return None
        msg = self._sock.recv_multipart(copy=False)
        rank = _rank_of(msg[0].bytes)
        if rank is None:
            identity = msg[0].bytes[:32]
            error = ProtocolError(RejectCode.MALFORMED, f"a peer with identity {identity!r} is not a rank")
            return Received(-1, None, error)
        try:
            return Received(rank, self._stamp.decode(msg[1:], rank), None)
        except ProtocolError as exc:
            return Received(rank, None, exc)

    def forget(self, rank: int) -> None:
        """Forget a rank's replay history, for a new process that takes its place."""
        self._stamp.replay.forget(rank)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.disable_monitor()
        self._monitor.close()
        self._sock.close()
        self._context.term()
        if self.address.startswith("ipc://"):
            directory = os.path.dirname(self.address[len("ipc://") :])
            if directory in _PRIVATE_DIRS:
                _PRIVATE_DIRS.discard(directory)
                shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> SchedulerEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ExecutorEndpoint:
    """One rank's side: connects to the scheduler with identity b"rank-<rank>"."""

    def __init__(
        self,
        address: str,
        key: bytes,
        run_id: str,
        rank: int,
        *,
        supported_versions: Iterable[int] = SUPPORTED_VERSIONS,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.rank = rank
        self.address = address
        self._stamp = _Stamp(key, run_id, supported_versions, limits)
        self._context = zmq.Context()
        self._sock = _socket(self._context, zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, identity_of(rank))
        try:
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._context.term()
            raise TransportError(f"cannot connect rank {rank} to {address}: {exc}") from exc
        self._closed = False

    @property
    def version(self) -> int:
        return self._stamp.version

    @version.setter
    def version(self, value: int) -> None:
        self._stamp.version = value

    def send(self, body: Body, step: int) -> None:
        try:
            self._sock.send_multipart(self._stamp.encode(body, step))
        except zmq.ZMQError as exc:
            raise TransportError(f"rank {self.rank} cannot send to {self.address}: {exc}") from exc

    def recv(self, timeout_ms: int) -> Frame | None:
        """The next frame from the scheduler, or None after timeout_ms (-1: wait for ever).

        Raises ProtocolError for a frame that fails any check, so the caller can answer REJECT.
        """
        if not self._sock.poll(timeout_ms, zmq.POLLIN):
            return None
        return self._stamp.decode(self._sock.recv_multipart(copy=False), _SCHEDULER)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close()
        self._context.term()

    def __enter__(self) -> ExecutorEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
