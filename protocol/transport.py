"""A thin pyzmq shell around the codec: the scheduler's ROUTER and each executor's DEALER.

Delivery is reliable: ROUTER_MANDATORY makes a send to a peer that is not connected raise instead of
vanishing, and unlimited high-water marks mean a slow peer queues frames rather than losing them.
Both ends stamp version, layout, run id and seq on send; on receive they check the MAC (codec) and
the replay counter. What a frame means (its envelope against the negotiated version, its step, its
type in the current state) is protocol.conversation's business, not the transport's.

Who is who on the scheduler's socket. The ROUTER gives every connection a routing id of its own
making; executors set none. A connection becomes rank r's when its first authenticated frame is a
HELLO saying rank r (and r has no live connection yet); its frames are attributed to r from then on.
A peer-chosen identity would not do: a stranger that connected first with identity "rank-1" would
silently mute the real rank 1 (libzmq keeps the first of two equal identities and drops the other's
messages; ROUTER_HANDOVER instead lets a later stranger take the identity over), and "rank-01" would
be read as rank 1. So anything that is not one of the launched ranks (a connection that sends
nothing, garbage, a frame whose MAC fails, an authenticated frame before a HELLO) is logged, counted
in `peer_stats()` and ignored: it never reaches the caller, never aborts a step, never ends the
service. A frame with a good MAC on a rank's connection that fails a later check is that rank's
doing, and is handed to the caller as a Received with its error.

Closed connections are watched with a socket monitor (EVENT_ACCEPTED / EVENT_DISCONNECTED, which
carry the connection's file descriptor) matched with each rank's first frame's ZMQ_SRCFD, so that
`disconnected_ranks()` says which launched rank's connection closed. ZMQ_ROUTER_NOTIFY would give
this directly, but it is a draft option: with pyzmq 27.3's bundled libzmq 4.3.5 (draft API off)
setting it fails with EINVAL (docs/protocol.md).

On tcp:// across hosts pass `curve` (protocol.curve): the scheduler is a CURVE server that admits only
the given executor keys (ZAP, with ZAP_ENFORCE_DOMAIN so that no handler means no admission), and an
executor pins the server's key. A peer that fails the CURVE handshake never gets a frame through.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from protocol.auth import ReplayGuard
from protocol.codec import DEFAULT_LIMITS, Limits, decode_verified, encode, verify
from protocol.curve import ZAP_DOMAIN, ClientCurve, ServerCurve
from protocol.errors import ProtocolError, TransportError
from protocol.frames import LAYOUT_VERSION, SUPPORTED_VERSIONS, Body, Frame, Hello

log = logging.getLogger("tp_runtime.transport")

# Long enough for a SHUTDOWN queued just before close() to leave, short enough that close() never
# hangs on a peer that went away.
LINGER_MS = 200
_SCHEDULER = "scheduler"
_MONITORED = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_HANDSHAKE_FAILED = _MONITORED & ~(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
_IGNORED_PAST_DEADLINE = 64

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


def remove_private_dirs() -> None:
    """Removes every directory ipc_address() made in this process that no endpoint has removed: for
    a process that exits while, or before, its endpoint binds there (a signal between the two)."""
    while _PRIVATE_DIRS:
        shutil.rmtree(_PRIVATE_DIRS.pop(), ignore_errors=True)


def _first_seq() -> int:
    # seq only has to increase per sender; starting from the wall clock lets a restarted process
    # be accepted by a receiver that remembers its predecessor.
    return time.time_ns()


class _Stamp:
    """Envelope fields shared by both endpoint kinds, and the receive-side authentication."""

    def __init__(self, key: bytes, run_id: str, supported_versions: Iterable[int], limits: Limits) -> None:
        self.key = key
        self.run_id = run_id
        self.version = max(supported_versions)
        self.layout = LAYOUT_VERSION
        self.limits = limits
        self.replay = ReplayGuard()
        self._seq = _first_seq()

    def encode(self, body: Body, step: int) -> list[bytes]:
        self._seq += 1
        frame = Frame(self.version, self.layout, self.run_id, step, self._seq, body)
        return encode(frame, self.key)


def _socket(context: zmq.Context, kind: int) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


@dataclass(frozen=True)
class Received:
    """One frame from a launched rank, or the error its authenticated parts failed with."""

    rank: int
    frame: Frame | None
    error: ProtocolError | None


@dataclass(frozen=True)
class PeerStats:
    """What the scheduler's socket ignored or saw end, since it was bound (for /metrics)."""

    connections_accepted: int
    unbound_disconnects: int  # connections that closed without becoming a rank's (strangers, probes)
    unauthenticated_frames: int  # failed the part count, size or MAC: not from a holder of the key
    unbound_frames: int  # authenticated, but not a HELLO that could claim a rank for its connection
    handshake_failures: int  # ZMTP/CURVE handshakes refused (unknown client key, no CURVE, garbage)
    rank_disconnects: int  # launched ranks' connections that closed


class _AllowedKeys:
    """pyzmq's ZAP credentials provider: admits exactly the given CURVE public keys (Z85)."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == ZAP_DOMAIN and key in self._keys


class _IgnoredLog:
    """Counts what was ignored, by kind, and logs the 1st, 10th, 100th ... of each: a flood of
    garbage costs a counter increment, not a log line per frame."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def note(self, kind: str, what: str) -> None:
        n = self.counts.get(kind, 0) + 1
        self.counts[kind] = n
        if str(n).rstrip("0") == "1":
            log.warning("%s (%d so far): %s", kind.replace("_", " "), n, what)


class _Waker:
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


class SchedulerEndpoint:
    """The scheduler's side: binds, learns which connection is which rank from its HELLO, and
    talks to every rank by its rank number."""

    def __init__(
        self,
        address: str,
        key: bytes,
        run_id: str,
        *,
        supported_versions: Iterable[int] = SUPPORTED_VERSIONS,
        limits: Limits = DEFAULT_LIMITS,
        curve: ServerCurve | None = None,
    ) -> None:
        self._stamp = _Stamp(key, run_id, supported_versions, limits)
        self._context = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._sock = _socket(self._context, zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._closed = False
        try:
            if curve is not None:
                self._auth = ThreadAuthenticator(self._context, log=logging.getLogger("tp_runtime.transport.zap"))
                self._auth.start()
                self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_AllowedKeys(curve.allowed_clients))
                self._sock.curve_server = True
                self._sock.curve_publickey = curve.public_key
                self._sock.curve_secretkey = curve.secret_key
                self._sock.zap_domain = ZAP_DOMAIN.encode()
                self._sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            self._monitor = self._sock.get_monitor_socket(_MONITORED)
            self._sock.bind(address)
        except zmq.ZMQError as exc:
            self._teardown()
            raise TransportError(f"cannot bind the scheduler endpoint to {address}: {exc}") from exc
        self.address: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._waker = _Waker(self._sock)
        self._route_of: dict[int, bytes] = {}  # rank -> routing id
        self._rank_of: dict[bytes, int] = {}  # routing id -> rank
        self._fd_of: dict[int, int] = {}  # rank -> its connection's file descriptor
        self._live_fds: set[int] = set()
        self._disconnected: set[int] = set()
        self._ignored = _IgnoredLog()
        self._accepted = 0
        self._rank_disconnects = 0

    @property
    def version(self) -> int:
        return self._stamp.version

    @version.setter
    def version(self, value: int) -> None:
        self._stamp.version = value

    @property
    def run_id(self) -> str:
        return self._stamp.run_id

    @property
    def ranks(self) -> frozenset[int]:
        """The ranks whose connection said HELLO and is still open."""
        self._watch_connections()
        return frozenset(self._route_of)

    def disconnected_ranks(self) -> set[int]:
        """The launched ranks whose connection closed since the last call (their process ended)."""
        self._watch_connections()
        gone, self._disconnected = self._disconnected, set()
        return gone

    def peer_stats(self) -> PeerStats:
        self._watch_connections()
        c = self._ignored.counts
        return PeerStats(
            connections_accepted=self._accepted,
            unbound_disconnects=c.get("unbound_disconnects", 0),
            unauthenticated_frames=c.get("unauthenticated_frames", 0),
            unbound_frames=c.get("unbound_frames", 0),
            handshake_failures=c.get("handshake_failures", 0),
            rank_disconnects=self._rank_disconnects,
        )

    def send(self, rank: int, body: Body, step: int) -> None:
        self._send_parts((rank,), self._stamp.encode(body, step))

    def send_all(self, ranks: Iterable[int], body: Body, step: int) -> None:
        """Encode once, send the same parts to every rank."""
        self._send_parts(ranks, self._stamp.encode(body, step))

    def _send_parts(self, ranks: Iterable[int], parts: list[bytes]) -> None:
        for rank in ranks:
            route = self._route_of.get(rank)
            if route is None:
                raise TransportError(f"rank {rank} is not connected to {self.address}")
            try:
                self._sock.send_multipart([route, *parts])
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    raise TransportError(f"rank {rank} is not connected to {self.address}") from exc
                raise TransportError(f"cannot send to rank {rank}: {exc}") from exc

    def wake(self) -> None:
        """Make a recv that is waiting, or the next one, return None at once; any thread may call it
        (the frontend's HTTP thread does when it hands the engine thread a request)."""
        self._waker.wake()

    def recv(self, timeout_ms: int) -> Received | None:
        """The next frame from a launched rank, or None after timeout_ms (-1: wait for ever) or a
        wake(). What strangers send is ignored on the way: it does not end the wait early, and
        frames queued behind it are still read (up to _IGNORED_PAST_DEADLINE ignored ones after the
        deadline, so a flood cannot hold the caller's loop)."""
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        late = 0
        while late <= _IGNORED_PAST_DEADLINE:
            left = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self._waker.poll(left):
                return None
            received = self._accept(self._sock.recv_multipart(copy=False))
            if received is not None:
                return received
            late += deadline is not None and time.monotonic() >= deadline
        return None

    def _accept(self, msg: list[zmq.Frame]) -> Received | None:
        # Connection events that precede this message are in the monitor by now: a disconnect of a
        # stranger whose descriptor this message's connection reuses is seen before it.
        self._watch_connections()
        route, parts = msg[0].bytes, msg[1:]
        try:
            views = verify(parts, self._stamp.key, self._stamp.limits)
        except ProtocolError as exc:
            self._ignored.note("unauthenticated_frames", f"from connection {route.hex()}: {exc}")
            return None
        rank = self._rank_of.get(route)
        try:
            frame = decode_verified(views, self._stamp.limits)
        except ProtocolError as exc:
            if rank is None:
                self._ignored.note("unbound_frames", f"from connection {route.hex()} before a HELLO: {exc}")
                return None
            return Received(rank, None, exc)
        if rank is None:
            return self._claim(route, parts[0].get(zmq.SRCFD), frame)
        try:
            self._stamp.replay.check(rank, frame.seq)
        except ProtocolError as exc:
            return Received(rank, None, exc)
        return Received(rank, frame, None)

    def _claim(self, route: bytes, fd: int, frame: Frame) -> Received | None:
        """A connection's first authenticated frame: a HELLO makes it its rank's."""
        body = frame.body
        if not isinstance(body, Hello) or body.rank < 0:
            self._ignored.note("unbound_frames", f"{frame.type.name} from connection {route.hex()} before a HELLO")
            return None
        if body.rank in self._route_of:
            self._ignored.note("unbound_frames", f"a HELLO for rank {body.rank}, which is connected already")
            return None
        try:
            self._stamp.replay.check(body.rank, frame.seq)
        except ProtocolError as exc:
            self._ignored.note("unbound_frames", f"a HELLO for rank {body.rank} on a new connection: {exc}")
            return None
        self._route_of[body.rank] = route
        self._rank_of[route] = body.rank
        self._fd_of[body.rank] = fd
        if fd not in self._live_fds:  # it closed right after sending (the monitor saw it first)
            self._lost(body.rank)
        return Received(body.rank, frame, None)

    def _watch_connections(self) -> None:
        while self._monitor.get(zmq.EVENTS) & zmq.POLLIN:
            event = recv_monitor_message(self._monitor)
            kind, fd = event["event"], int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                self._accepted += 1
                self._live_fds.add(fd)
            elif kind == zmq.EVENT_DISCONNECTED:
                self._live_fds.discard(fd)
                rank = next((r for r, f in self._fd_of.items() if f == fd), None)
                if rank is None:
                    self._ignored.note("unbound_disconnects", "a connection closed without saying HELLO")
                else:
                    log.warning("rank %d's connection closed", rank)
                    self._lost(rank)
            elif kind & _HANDSHAKE_FAILED:
                self._ignored.note(
                    "handshake_failures", f"{zmq.Event(kind).name}: an unknown CURVE key, no CURVE, or not ZMTP"
                )

    def _lost(self, rank: int) -> None:
        self._rank_of.pop(self._route_of.pop(rank), None)
        self._fd_of.pop(rank, None)
        self._disconnected.add(rank)
        self._rank_disconnects += 1

    def forget(self, rank: int) -> None:
        """Forget a rank's replay history, for a new process that takes its place."""
        self._stamp.replay.forget(rank)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._teardown()
        if self.address.startswith("ipc://"):
            directory = os.path.dirname(self.address[len("ipc://") :])
            if directory in _PRIVATE_DIRS:
                _PRIVATE_DIRS.discard(directory)
                shutil.rmtree(directory, ignore_errors=True)

    def _teardown(self) -> None:
        if hasattr(self, "_monitor"):
            self._sock.disable_monitor()
            self._monitor.close()
        self._sock.close()
        if self._auth is not None:
            self._auth.stop()
        self._context.term()
        if hasattr(self, "_waker"):
            self._waker.close()

    def __enter__(self) -> SchedulerEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    ) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.rank = rank
        self.address = address
        self._stamp = _Stamp(key, run_id, supported_versions, limits)
        self._context = zmq.Context()
        self._sock = _socket(self._context, zmq.DEALER)
        # With CURVE a key that the scheduler does not admit, or a server key that is not the
        # scheduler's, fails every handshake and libzmq retries for ever in silence: the monitor
        # turns the first failure into an error that names the cause.
        self._monitor: zmq.Socket | None = None
        try:
            if curve is not None:
                self._sock.curve_publickey = curve.public_key
                self._sock.curve_secretkey = curve.secret_key
                self._sock.curve_serverkey = curve.server_key
                self._monitor = self._sock.get_monitor_socket(_HANDSHAKE_FAILED)
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._context.term()
            raise TransportError(f"cannot connect rank {rank} to {address}: {exc}") from exc
        self._waker = _Waker(self._sock)
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
        parts = self._sock.recv_multipart(copy=False)
        frame = decode_verified(verify(parts, self._stamp.key, self._stamp.limits), self._stamp.limits)
        self._stamp.replay.check(_SCHEDULER, frame.seq)
        return frame

    def _check_handshake(self) -> None:
        if self._monitor is None or not self._monitor.get(zmq.EVENTS) & zmq.POLLIN:
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
