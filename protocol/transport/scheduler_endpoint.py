"""The scheduler's end of the frame socket: a ROUTER that binds, learns which connection is which
rank from its HELLO (the package's docstring says why not from a peer-chosen identity), and watches
connections close."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from protocol.codec import DEFAULT_LIMITS, Limits, decode_verified, open_message
from protocol.curve import ZAP_DOMAIN, ServerCurve
from protocol.errors import ProtocolError, TransportError
from protocol.frames import SUPPORTED_VERSIONS, Body, Frame, Hello
from protocol.transport.ipc import remove_private_dir
from protocol.transport.sockets import HANDSHAKE_FAILED, POLLIN, new_socket
from protocol.transport.stamp import Stamp
from protocol.transport.waker import Waker

log = logging.getLogger("tp_runtime.transport")

_MONITORED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
_IGNORED_PAST_DEADLINE = 64


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
        self._stamp = Stamp(key, run_id, supported_versions, limits)
        self._context = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._sock = new_socket(self._context, zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._closed = False
        try:
            if curve is not None:
                self._serve_curve(curve)
            self._monitor = self._sock.get_monitor_socket(_MONITORED)
            self._sock.bind(address)
        except zmq.ZMQError as exc:
            self._teardown()
            raise TransportError(f"cannot bind the scheduler endpoint to {address}: {exc}") from exc
        self.address: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        # A rank's closed connection ends the engine's wait: its death is seen at once.
        self._waker = Waker(self._sock, {self._monitor: self._loss_news})
        self._route_of: dict[int, bytes] = {}  # rank -> routing id
        self._rank_of: dict[bytes, int] = {}  # routing id -> rank
        self._fd_of: dict[int, int] = {}  # rank -> its connection's file descriptor
        self._live_fds: set[int] = set()
        self._disconnected: list[int] = []
        # A rank's connection closed and no recv has returned for it yet: whichever reader took
        # the monitor's event (a stranger's frame, peer_stats), the next wait ends at once.
        self._loss_unsaid = False
        self._ignored = _IgnoredLog()
        self._accepted = 0
        self._rank_disconnects = 0

    def _serve_curve(self, curve: ServerCurve) -> None:
        """A CURVE server that admits only the launch's executor keys: ZAP_ENFORCE_DOMAIN makes a
        missing handler refuse everyone rather than admit everyone."""
        self._auth = ThreadAuthenticator(self._context, log=logging.getLogger("tp_runtime.transport.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_AllowedKeys(curve.allowed_clients))
        self._sock.curve_server = True
        self._sock.curve_publickey = curve.public_key
        self._sock.curve_secretkey = curve.secret_key
        self._sock.zap_domain = ZAP_DOMAIN.encode()
        self._sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def admit(self, clients: frozenset[bytes]) -> None:
        """Replaces the CURVE client keys the server admits (from now on; connections made stay).
        Where the executors make their keys per process, the scheduler learns them only after it
        has bound, from the request of the group that will connect."""
        if self._auth is None:
            raise TransportError(f"the scheduler endpoint {self.address} is not a CURVE server: it admits no keys")
        # The authenticator's thread looks the provider up per handshake: one dict item, set whole.
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_AllowedKeys(clients))

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

    def disconnected_ranks(self) -> list[int]:
        """The launched ranks whose connection closed since the last call (their process ended), in
        the order the closes were seen: when a killed rank takes its peer down with it (a collective
        fails under the peer, which exits), the first one is the cause."""
        self._watch_connections()
        gone, self._disconnected = self._disconnected, []
        self._loss_unsaid = False  # said here
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
        self.send_message((rank,), self._stamp.encode(body, step))

    def send_all(self, ranks: Iterable[int], body: Body, step: int) -> None:
        """Encode once, send the same message to every rank."""
        self.send_message(ranks, self._stamp.encode(body, step))

    def send_message(self, ranks: Iterable[int], message: bytes) -> None:
        """One frame's message (Stamp.encode's, or a fuzzer's bytes) to each of `ranks`."""
        for rank in ranks:
            route = self._route_of.get(rank)
            if route is None:
                raise TransportError(f"rank {rank} is not connected to {self.address}")
            try:
                self._sock.send_multipart([route, message])
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    raise TransportError(f"rank {rank} is not connected to {self.address}") from exc
                raise TransportError(f"cannot send to rank {rank}: {exc}") from exc

    def wake(self) -> None:
        """Make a recv that is waiting, or the next one, return None at once; any thread may call it
        (the frontend's HTTP thread does when it hands the engine thread a request)."""
        self._waker.wake()

    def recv(self, timeout_ms: int) -> Received | None:
        """The next frame from a launched rank, or None after timeout_ms (-1: wait for ever), a
        wake(), or a rank's closed connection (disconnected_ranks names it). What strangers send,
        and their connections, are ignored on the way: they do not end the wait early, and
        frames queued behind it are still read (up to _IGNORED_PAST_DEADLINE ignored ones after the
        deadline, so a flood cannot hold the caller's loop)."""
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        late = 0
        while late <= _IGNORED_PAST_DEADLINE:
            if self._loss_unsaid:
                self._loss_unsaid = False
                return None
            # Rounded up: truncated, the microseconds spent since the deadline was set made a 1 ms
            # wait a poll that returns at once, and the engine loop spun (dozens of empty polls
            # before each liveness look) until the deadline had passed.
            left = -1 if deadline is None else max(0, math.ceil((deadline - time.monotonic()) * 1000))
            if not self._waker.poll(left):
                self._loss_unsaid = False
                return None
            received = self._accept(self._sock.recv_multipart(copy=False))
            if received is not None:
                return received
            late += deadline is not None and time.monotonic() >= deadline
        return None

    def _accept(self, msg: list[zmq.Frame]) -> Received | None:
        route, parts = msg[0].bytes, msg[1:]
        if route not in self._rank_of:
            # Connection events that precede this message are in the monitor by now: a disconnect of
            # a stranger whose descriptor this message's connection reuses is seen before it. A
            # rank's own connection has been claimed already (the ROUTER's routing ids are never
            # reused), so its frames skip the monitor's getsockopt, a system call each.
            self._watch_connections()
        try:
            views = open_message(parts, self._stamp.key, self._stamp.limits)
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

    def _loss_news(self) -> bool:
        """The monitor's events taken (the waker's reader): whether a rank's connection closed that
        no recv has returned for."""
        self._watch_connections()
        return self._loss_unsaid

    def _watch_connections(self) -> None:
        while self._monitor.get(zmq.EVENTS) & POLLIN:
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
            elif kind & HANDSHAKE_FAILED:
                self._ignored.note(
                    "handshake_failures", f"{zmq.Event(kind).name}: an unknown CURVE key, no CURVE, or not ZMTP"
                )

    def _lost(self, rank: int) -> None:
        self._rank_of.pop(self._route_of.pop(rank), None)
        self._fd_of.pop(rank, None)
        if rank not in self._disconnected:
            self._disconnected.append(rank)
        self._rank_disconnects += 1
        self._loss_unsaid = True

    def forget(self, rank: int) -> None:
        """Forget a rank's replay history, for a new process that takes its place."""
        self._stamp.replay.forget(rank)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._teardown()
        remove_private_dir(self.address)

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
