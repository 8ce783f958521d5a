"""Peers on the scheduler's frame socket that are not launched ranks: a connection that sends
nothing, one that calls itself rank-1 or rank-00 (before and after the real rank 1 connects), one
that sends garbage, one whose frames fail the MAC, a key holder's frame before its HELLO, a second
HELLO for a connected rank. None of them is fatal or reported; each is counted; the real ranks' steps
complete; and the connection a real rank loses is reported by its rank, never a stranger's."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from protocol.codec import encode, to_message
from protocol.conversation import StepDone
from protocol.frames import PROTOCOL_VERSION, Frame, Ready
from protocol.transport import ExecutorEndpoint, SchedulerEndpoint, ipc_address
from tests.protocol.wire_peers import SchedulerDriver, run_executor
from tests.protocol.wire_samples import GEOMETRY, KEY, RUN_ID, valid_prepare
from tests.protocol.conversation_helpers import hello

WORLD = 2


class Stranger:
    def __init__(self, address: str, identity: bytes | None = None) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(address)

    def send(self, *parts: bytes) -> Stranger:
        self.sock.send_multipart(list(parts))
        return self

    def close(self) -> None:
        self.sock.close()
        self.context.term()


def settle(endpoint: SchedulerEndpoint, condition, timeout_s: float = 5.0) -> None:
    """Read (and so ignore) what strangers sent until `condition` holds; nothing may be reported."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out: {endpoint.peer_stats()}"
        assert endpoint.recv(20) is None


def signed(body: object, step: int = 0, key: bytes = KEY, seq: int = 1) -> list[bytes]:
    """A frame as the ZeroMQ parts a peer sends: its one message."""
    return [to_message(encode(Frame(PROTOCOL_VERSION, 1, RUN_ID, step, seq, body), key))]


@pytest.fixture
def endpoint() -> Iterator[SchedulerEndpoint]:
    ep = SchedulerEndpoint(ipc_address(), KEY, RUN_ID)
    yield ep
    ep.close()


def start_ranks(address: str) -> list[threading.Thread]:
    threads = [
        threading.Thread(target=run_executor, args=(address, KEY, RUN_ID, r, WORLD, GEOMETRY), daemon=True)
        for r in range(WORLD)
    ]
    for t in threads:
        t.start()
    return threads


def test_strangers_are_counted_and_ignored_and_the_ranks_steps_complete(endpoint: SchedulerEndpoint) -> None:
    a = endpoint.address
    strangers = []
    # Before the ranks: connect-and-close, a squatter on "rank-1", garbage from "rank-00", a HELLO
    # for rank 0 signed with the wrong key.
    for _ in range(5):
        Stranger(a).close()
    squatter = Stranger(a, b"rank-1")
    strangers.append(Stranger(a, b"rank-00").send(b"garbage"))
    strangers.append(Stranger(a).send(*signed(hello(0), key=bytes(32))))
    threads = start_ranks(a)
    driver = SchedulerDriver(endpoint, WORLD, RUN_ID)
    driver.handshake()
    assert endpoint.ranks == {0, 1}
    # After: another "rank-1" (libzmq mutes the second of two equal identities: what it sends never
    # arrives), a "rank-0" that sends garbage, a bad MAC, a key holder's READY before any HELLO, a
    # second HELLO for rank 1 from a new connection, and more connect-and-close.
    strangers.append(squatter)
    strangers.append(Stranger(a, b"rank-1").send(b"x", b"y", b"z"))
    strangers.append(Stranger(a, b"rank-0").send(b"x", b"y"))
    strangers.append(Stranger(a).send(*signed(Ready(1), step=1, key=bytes(range(1, 33)))))
    strangers.append(Stranger(a).send(*signed(Ready(0), step=1, seq=time.time_ns())))
    strangers.append(Stranger(a).send(*signed(hello(1), seq=time.time_ns())))
    for _ in range(5):
        Stranger(a).close()
    for step in (1, 2):
        done = driver.step(valid_prepare(seed=step))
        assert isinstance(done, StepDone) and done.step == step
    settle(endpoint, lambda: endpoint.peer_stats().unauthenticated_frames == 4)
    settle(endpoint, lambda: endpoint.peer_stats().unbound_disconnects >= 10)
    stats = endpoint.peer_stats()
    assert stats.unauthenticated_frames == 4  # garbage from rank-00 and rank-0, two wrong keys
    assert stats.unbound_frames == 2  # the READY before a HELLO, the second HELLO for rank 1
    assert stats.rank_disconnects == 0 and endpoint.disconnected_ranks() == []
    assert stats.connections_accepted == WORLD + 18
    for s in strangers:
        s.close()
    settle(endpoint, lambda: endpoint.peer_stats().unbound_disconnects == 18)
    assert endpoint.disconnected_ranks() == [] and endpoint.ranks == {0, 1}
    driver.shutdown("test over")
    for t in threads:
        t.join(timeout=10)
    settle(endpoint, lambda: endpoint.peer_stats().rank_disconnects == WORLD)
    assert sorted(endpoint.disconnected_ranks()) == [0, 1] and endpoint.ranks == set()


def test_a_ranks_closed_connection_is_reported_by_its_rank_never_a_strangers(endpoint: SchedulerEndpoint) -> None:
    # Strangers come and go right before each rank connects, so that a rank's connection may get a
    # file descriptor a stranger just gave back: the stranger's disconnect must not be taken for it.
    peers = []
    for rank in range(3):
        for _ in range(3):
            Stranger(endpoint.address).close()
        peer = ExecutorEndpoint(endpoint.address, KEY, RUN_ID, rank)
        peer.send(hello(rank, world=3), step=0)
        got = endpoint.recv(5000)
        assert got is not None and got.rank == rank
        peers.append(peer)
    settle(endpoint, lambda: endpoint.peer_stats().unbound_disconnects == 9)
    assert endpoint.disconnected_ranks() == [] and endpoint.ranks == {0, 1, 2}
    peers[1].close()
    settle(endpoint, lambda: endpoint.peer_stats().rank_disconnects == 1)
    assert endpoint.disconnected_ranks() == [1]
    assert endpoint.disconnected_ranks() == []  # reported once
    assert endpoint.ranks == {0, 2}
    # A new process in rank 1's place is rank 1 again once it says HELLO.
    peers[1] = ExecutorEndpoint(endpoint.address, KEY, RUN_ID, 1)
    peers[1].send(hello(1, world=3), step=0)
    got = endpoint.recv(5000)
    assert got is not None and got.rank == 1 and endpoint.ranks == {0, 1, 2}
    # Closed in turn and read at once: the order the closes were seen is the order they are said
    # in (the first is the cause when a killed rank takes its peers down with it).
    for count, rank in enumerate((2, 0, 1), start=2):
        peers[rank].close()
        settle(endpoint, lambda count=count: endpoint.peer_stats().rank_disconnects == count)
    assert endpoint.disconnected_ranks() == [2, 0, 1]


def test_a_flood_of_garbage_does_not_end_the_wait_early_or_fill_the_log(endpoint: SchedulerEndpoint, caplog) -> None:
    stranger = Stranger(endpoint.address)
    for _ in range(300):
        stranger.send(b"\x00" * 40)
    started = time.monotonic()
    assert endpoint.recv(400) is None
    assert time.monotonic() - started >= 0.35
    assert endpoint.peer_stats().unauthenticated_frames == 300
    assert len([r for r in caplog.records if "unauthenticated" in r.getMessage()]) == 3  # the 1st, 10th, 100th
    stranger.close()


def test_a_ranks_frame_queued_behind_garbage_is_read_by_a_zero_timeout_recv(endpoint: SchedulerEndpoint) -> None:
    # One connection, so the order is fixed: rank 0's HELLO, 40 frames that fail the MAC, a READY.
    peer = Stranger(endpoint.address).send(*signed(hello(0, world=1), seq=1))
    assert endpoint.recv(5000).rank == 0
    for _ in range(40):
        peer.send(b"garbage", bytes(32))
    peer.send(*signed(Ready(0), step=1, seq=2))
    time.sleep(0.3)  # everything is queued at the scheduler's socket
    got = endpoint.recv(0)
    assert got is not None and got.frame.body == Ready(0)
    assert endpoint.peer_stats().unauthenticated_frames == 40
    peer.close()


def test_a_ranks_closed_connection_ends_the_wait_at_once_and_a_strangers_does_not(endpoint: SchedulerEndpoint) -> None:
    # The engine's loop looks at liveness when a threshold can be crossed, not on a clock: a rank's
    # death must end its wait, and strangers coming and going must not.
    peer = ExecutorEndpoint(endpoint.address, KEY, RUN_ID, 0)
    peer.send(hello(0, world=1), step=0)
    assert endpoint.recv(5000).rank == 0
    for _ in range(5):
        Stranger(endpoint.address).close()
    started = time.monotonic()
    assert endpoint.recv(400) is None
    assert time.monotonic() - started >= 0.35
    assert endpoint.peer_stats().unbound_disconnects == 5 and endpoint.disconnected_ranks() == []
    closer = threading.Timer(0.1, peer.close)
    closer.start()
    try:
        started = time.monotonic()
        assert endpoint.recv(20_000) is None
        assert time.monotonic() - started < 10  # the close ended it, not the timeout
        assert endpoint.disconnected_ranks() == [0]
    finally:
        closer.cancel()
        closer.join()
        peer.close()


def test_a_ranks_close_read_by_another_reader_still_ends_the_next_wait(endpoint: SchedulerEndpoint) -> None:
    # The monitor's events are read wherever the socket needs them (a stranger's frame, the
    # counters /metrics shows): a rank's close taken there must still end the engine's next wait.
    peer = ExecutorEndpoint(endpoint.address, KEY, RUN_ID, 0)
    peer.send(hello(0, world=1), step=0)
    assert endpoint.recv(5000).rank == 0
    peer.close()
    deadline = time.monotonic() + 10
    while endpoint.peer_stats().rank_disconnects == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    started = time.monotonic()
    assert endpoint.recv(20_000) is None
    assert time.monotonic() - started < 10
    assert endpoint.disconnected_ranks() == [0]
    started = time.monotonic()
    assert endpoint.recv(300) is None  # said once: the wait after it runs its time
    assert time.monotonic() - started >= 0.25
