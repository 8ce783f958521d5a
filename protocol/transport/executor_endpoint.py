"""One rank's end of the frame socket: a DEALER that connects to the scheduler."""

from __future__ import annotations

from collections.abc import Iterable

import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol.codec import DEFAULT_LIMITS, Limits, decode_verified, open_message
from protocol.curve import ClientCurve
from protocol.errors import TransportError
from protocol.frames import SUPPORTED_VERSIONS, Body, Frame
from protocol.transport.sockets import HANDSHAKE_FAILED, POLLIN, new_socket
from protocol.transport.stamp import Stamp
from protocol.transport.waker import Waker

# The replay guard's name for the one sender an executor hears from.
_SCHEDULER = "scheduler"


class ExecutorEndpoint:
    """One rank's side: connects to the scheduler; its HELLO tells the scheduler which rank it is."""

    def __init__(
        self,
        address: str,
        key: bytes,
        run_id: str,
        rank: int,
        *,
        supported_versions: Iterable[int] = SUPPORTED_VERSIONS,
        limits: Limits = DEFAULT_LIMITS,
        curve: ClientCurve | None = None,
        wake_holding_gil: bool = False,
    ) -> None:
        """wake_holding_gil: wake() keeps the GIL (Waker's hold_gil says when that pays)."""
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.rank = rank
        self.address = address
        self._stamp = Stamp(key, run_id, supported_versions, limits)
        self._context = zmq.Context()
        self._sock = new_socket(self._context, zmq.DEALER)
        # With CURVE a key that the scheduler does not admit, or a server key that is not the
        # scheduler's, fails every handshake and libzmq retries for ever in silence: the monitor
        # turns the first failure into an error that names the cause.
        self._monitor: zmq.Socket | None = None
        try:
            if curve is not None:
                self._sock.curve_publickey = curve.public_key
                self._sock.curve_secretkey = curve.secret_key
                self._sock.curve_serverkey = curve.server_key
                self._monitor = self._sock.get_monitor_socket(HANDSHAKE_FAILED)
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._context.term()
            raise TransportError(f"cannot connect rank {rank} to {address}: {exc}") from exc
        self._waker = Waker(self._sock, hold_gil=wake_holding_gil)
        self._closed = False

    @property
    def version(self) -> int:
        return self._stamp.version

    @version.setter
    def version(self, value: int) -> None:
        self._stamp.version = value

    def send(self, body: Body, step: int) -> None:
        try:
            self._sock.send(self._stamp.encode(body, step))
        except zmq.ZMQError as exc:
            raise TransportError(f"rank {self.rank} cannot send to {self.address}: {exc}") from exc

    def wake(self) -> None:
        """Make a recv that is waiting, or the next one, return None at once; any thread may call it."""
        self._waker.wake()

    def recv(self, timeout_ms: int) -> Frame | None:
        """The next frame from the scheduler, or None after timeout_ms (-1: wait for ever) or a wake().

        Raises ProtocolError for a frame that fails the MAC, decoding or the replay check, so the
        caller can answer REJECT (only the scheduler can send on this connection).
        """
        self._check_handshake()
        if not self._waker.poll(timeout_ms):
            self._check_handshake()
            return None
        limits = self._stamp.limits
        frame = decode_verified(open_message(self._sock.recv_multipart(copy=False), self._stamp.key, limits), limits)
        self._stamp.replay.check(_SCHEDULER, frame.seq)
        return frame

    def _check_handshake(self) -> None:
        if self._monitor is None or not self._monitor.get(zmq.EVENTS) & POLLIN:
            return
        event = recv_monitor_message(self._monitor)
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = f"the scheduler refused this rank's CURVE key (ZAP status {event['value']})"
        else:
            why = "the server is not the scheduler whose CURVE key this rank pins, or it does not speak CURVE"
        raise TransportError(
            f"rank {self.rank} cannot reach the scheduler at {self.address}: {why}. Every host needs its own "
            "copy of the key directories that `tp-runtime keys` made for this launch (docs/deployment.md)"
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(0)
        self._sock.close()
        self._context.term()
        self._waker.close()

    def __enter__(self) -> ExecutorEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
