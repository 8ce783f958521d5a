"""Strangers on a scheduler's frame socket: peers without the launch's key, and what the socket must
count for each (protocol.transport's PeerStats, /metrics' tp_runtime_frame_socket_*).

An act opens connections of its own and closes them before it returns, so what it costs the socket
is known in advance (`Expected`): every connection is accepted and, once closed, is an unbound
disconnect; every message it sends fails the part count, the size or the MAC (garbage, a frame
signed with another key, a forged HELLO, a flood), and is an unauthenticated frame. A connection
that writes bytes which are no ZMTP greeting fails the handshake; a ZeroMQ peer that closes right
after it connects may or may not (how far its greeting got is a race), so handshake failures are a
range.

`stranger_acts()` is a hypothesis strategy of acts; `Strangers(address).perform(act)` runs one.
"""

from __future__ import annotations

import random
import socket
import time
from dataclasses import dataclass

import zmq
from hypothesis import strategies as st

from protocol.codec import encode, to_message
from protocol.frames import (
    LAYOUT_VERSION,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    CacheGeometry,
    Frame,
    Hello,
    Ready,
)

KINDS = ("connect_close", "raw_bytes", "garbage", "bad_mac", "forged_hello", "flood", "squatter")
# Identities a stranger may take: libzmq's ROUTER keeps the first holder of an identity, and the
# transport never reads a rank from one, so none of these may mute or impersonate a rank.
IDENTITIES = (None, b"rank-0", b"rank-1", b"rank-00", b"\x00\x80\x00\x00\x29", b"scheduler")
SEND_LINGER_MS = 2000  # a sender's messages are all delivered before its close returns
_GEOMETRY = CacheGeometry(16, 16, 2, 2, 8, "fp32", 512, 256, 8, 256)


@dataclass(frozen=True)
class StrangerAct:
    kind: str  # one of KINDS
    count: int  # connections (connect_close, raw_bytes) or messages (the others)
    identity: bytes | None = None
    seed: int = 0

    def describe(self) -> str:
        who = f" as {self.identity!r}" if self.identity is not None else ""
        return f"{self.kind} x{self.count}{who}"


@dataclass(frozen=True)
class Expected:
    """What the socket's counters must grow by."""

    connections: int = 0
    unauthenticated_frames: int = 0
    handshake_failures_min: int = 0
    handshake_failures_max: int = 0

    def __add__(self, other: Expected) -> Expected:
        return Expected(
            self.connections + other.connections,
            self.unauthenticated_frames + other.unauthenticated_frames,
            self.handshake_failures_min + other.handshake_failures_min,
            self.handshake_failures_max + other.handshake_failures_max,
        )


def stranger_acts(max_count: int = 50, flood: int = 5000) -> st.SearchStrategy[StrangerAct]:
    return st.builds(
        StrangerAct,
        kind=st.sampled_from(KINDS),
        count=st.integers(1, max_count),
        identity=st.sampled_from(IDENTITIES),
        seed=st.integers(0, 2**32 - 1),
    ).map(lambda act: StrangerAct(act.kind, flood, act.identity, act.seed) if act.kind == "flood" else act)


def expected(act: StrangerAct) -> Expected:
    if act.kind == "connect_close":
        return Expected(act.count, 0, 0, act.count)
    if act.kind == "raw_bytes":
        return Expected(act.count, 0, act.count, act.count)
    return Expected(1, act.count, 0, 0)


class Strangers:
    """Acts against one address, and the sum of what they must be counted as (`total`).

    libzmq's ROUTER drops the messages of a connection whose identity another connection still
    holds, and frees a closed connection's identity a moment after the close: an identity that an
    earlier act used gets a suffix, so that no count depends on that race."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.total = Expected()
        self.acts = 0
        self._used: set[bytes] = set()

    def perform(self, act: StrangerAct) -> Expected:
        identity = act.identity
        if identity is not None:
            if identity in self._used:
                identity = b"%s#%d" % (identity, self.acts)
            self._used.add(identity)
        cost = perform(self.address, StrangerAct(act.kind, act.count, identity, act.seed))
        self.total += cost
        self.acts += 1
        return cost


def perform(address: str, act: StrangerAct) -> Expected:
    """Runs one act against `address` (ipc:// or tcp://); returns what it must be counted as.
    Acts that reuse an identity right after each other may lose messages: use `Strangers`."""
    rng = random.Random(act.seed)
    if act.kind == "raw_bytes":
        _raw_connections(address, act.count, rng)
        return expected(act)
    context = zmq.Context()
    try:
        if act.kind == "connect_close":
            for _ in range(act.count):
                sock = _dealer(context, address, act.identity, linger=0)
                sock.close()
        else:
            sock = _dealer(context, address, act.identity, linger=SEND_LINGER_MS)
            for _ in range(act.count):
                sock.send_multipart(_message(act.kind, rng))
            if act.kind == "squatter":
                time.sleep(0.2)  # holds its identity while the ranks' frames flow
            sock.close()
    finally:
        context.term()
    return expected(act)


def _dealer(context: zmq.Context, address: str, identity: bytes | None, linger: int) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, linger)
    sock.setsockopt(zmq.SNDHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return sock


def _message(kind: str, rng: random.Random) -> list[bytes]:
    if kind in ("garbage", "squatter"):
        return [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 5))]
    if kind == "flood":
        return [rng.randbytes(rng.randint(0, 16))]
    wrong_key = rng.randbytes(32)
    seq = time.time_ns()
    if kind == "bad_mac":
        return [to_message(encode(Frame(PROTOCOL_VERSION, LAYOUT_VERSION, "guessed-run", rng.randint(0, 9), seq, Ready(rng.randint(0, 1))), wrong_key))]
    # A HELLO claiming a launched rank, signed with a guessed key: no key, no rank.
    rank = rng.randint(0, 1)
    hello = Hello(rank, 2, SUPPORTED_VERSIONS, LAYOUT_VERSION, "forged", _GEOMETRY, "", "stranger")
    return [to_message(encode(Frame(PROTOCOL_VERSION, LAYOUT_VERSION, "guessed-run", 0, seq, hello), wrong_key))]


# Bytes that are not a ZMTP greeting, each seen to fail libzmq's handshake every time. Random bytes
# would not do, nor a TLS ClientHello: libzmq reads some byte strings as a ZMTP 1.0 peer's length
# prefixes, and then as messages (ignored all the same, but not countable ahead).
_RAW_PROBES = (
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # a browser or a health checker on the wrong port
    b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + bytes(32),  # ZMTP 3, another mechanism
    b"\xff" + bytes(8) + b"\x7f",  # a ZMTP signature and nothing after it
    b"SSH-2.0-OpenSSH_9.6\r\n",
)


def _raw_connections(address: str, count: int, rng: random.Random) -> None:
    """Plain stream connections that write one of _RAW_PROBES, then close."""
    for _ in range(count):
        if address.startswith("ipc://"):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: object = address[len("ipc://") :]
        else:
            host, _, port = address[len("tcp://") :].rpartition(":")
            conn = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            target = (host.strip("[]"), int(port))
        with conn:
            conn.connect(target)
            try:
                conn.sendall(rng.choice(_RAW_PROBES))
            except OSError:  # the socket may hang up on a bad greeting before all of it is sent
                pass
