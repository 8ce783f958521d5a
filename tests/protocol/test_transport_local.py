"""Endpoints in one process: addresses, ranks learnt from HELLO, checks on receive, reliable sends,
clean close."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator

import pytest
import zmq

from protocol.codec import encode, frame_mac, to_message
from protocol.errors import ProtocolError, RejectCode, TransportError
from protocol.frames import PROTOCOL_VERSION as V
from protocol.frames import SUPPORTED_VERSIONS, Frame, Go, Hello, Ready
from protocol.transport import ExecutorEndpoint, SchedulerEndpoint, ipc_address
from tests.protocol.wire_samples import GEOMETRY, KEY, RUN_ID, valid_prepare

TIMEOUT_MS = 2000


def hello(rank: int, world: int = 4) -> Hello:
    return Hello(rank, world, SUPPORTED_VERSIONS, 1, "fp", GEOMETRY)


@pytest.fixture
def scheduler() -> Iterator[SchedulerEndpoint]:
    endpoint = SchedulerEndpoint(ipc_address(), KEY, RUN_ID)
    yield endpoint
    endpoint.close()


class RawPeer:
    """A DEALER that sends whatever parts a test wants, signed with the key it is given."""

    def __init__(self, address: str, key: bytes = KEY, identity: bytes | None = None) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(address)
        self.key = key
        self.seq = 100

    def frame(self, body: object, *, step: int = 1, version: int = V, run_id: str = RUN_ID, seq: int | None = None) -> list[bytes]:
        self.seq += 1
        return encode(Frame(version, 1, run_id, step, self.seq if seq is None else seq, body), self.key)

    def send(self, sections: list[bytes]) -> None:
        self.sock.send(to_message(sections))

    def close(self) -> None:
        self.sock.close()
        self.context.term()


@pytest.fixture
def rank0(scheduler: SchedulerEndpoint) -> Iterator[RawPeer]:
    """A raw peer whose HELLO made its connection rank 0's."""
    peer = RawPeer(scheduler.address)
    peer.send(peer.frame(hello(0), step=0))
    got = scheduler.recv(TIMEOUT_MS)
    assert got is not None and got.rank == 0 and isinstance(got.frame.body, Hello)
    yield peer
    peer.close()


def executor(address: str, rank: int = 0, key: bytes = KEY, run_id: str = RUN_ID) -> ExecutorEndpoint:
    return ExecutorEndpoint(address, key, run_id, rank)


def test_ipc_address_is_in_a_private_directory_removed_on_close() -> None:
    endpoint = SchedulerEndpoint(ipc_address("probe"), KEY, RUN_ID)
    path = endpoint.address.removeprefix("ipc://")
    directory = os.path.dirname(path)
    assert path.endswith("/probe.sock") and os.path.exists(path)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    endpoint.close()
    assert not os.path.exists(directory)
    endpoint.close()  # closing twice is harmless


def test_tcp_port_zero_resolves_to_the_bound_port() -> None:
    with SchedulerEndpoint("tcp://127.0.0.1:0", KEY, RUN_ID) as sched, executor(sched.address) as ex:
        assert sched.address.startswith("tcp://127.0.0.1:") and not sched.address.endswith(":0")
        ex.send(hello(0), step=0)
        ex.send(Ready(0), step=1)
        assert sched.recv(TIMEOUT_MS).rank == 0
        got = sched.recv(TIMEOUT_MS)
        assert got is not None and got.rank == 0 and got.error is None and got.frame.body == Ready(0)


def test_round_trip_stamps_the_envelope(scheduler: SchedulerEndpoint) -> None:
    with executor(scheduler.address, rank=3) as ex:
        ex.send(hello(3), step=0)
        got = scheduler.recv(TIMEOUT_MS)
        assert got.rank == 3 and got.error is None and scheduler.ranks == {3}
        assert (got.frame.version, got.frame.layout, got.frame.run_id) == (V, 1, RUN_ID)
        prepare = valid_prepare()
        scheduler.send(3, prepare, step=1)
        frame = ex.recv(TIMEOUT_MS)
        assert frame.step == 1 and frame.body.page_table.tolist() == prepare.page_table.tolist()
        assert ex.recv(10) is None  # timeout, nothing queued


def test_send_all_encodes_once_with_increasing_seq(scheduler: SchedulerEndpoint) -> None:
    peers = [executor(scheduler.address, rank=r) for r in range(3)]
    try:
        for rank, peer in enumerate(peers):
            peer.send(hello(rank), step=0)
            assert scheduler.recv(TIMEOUT_MS).error is None
        scheduler.send_all(range(3), Go(), step=1)
        scheduler.send_all(range(3), Go(), step=2)
        for peer in peers:
            first, second = peer.recv(TIMEOUT_MS), peer.recv(TIMEOUT_MS)
            assert (first.step, second.step) == (1, 2) and second.seq > first.seq
        seqs = set()
        scheduler.send_all(range(3), Go(), step=3)
        for peer in peers:
            seqs.add(peer.recv(TIMEOUT_MS).seq)
        assert len(seqs) == 1  # the same encoded parts went to every rank
    finally:
        for peer in peers:
            peer.close()


def test_sending_to_a_rank_that_is_not_connected_raises(scheduler: SchedulerEndpoint) -> None:
    with pytest.raises(TransportError, match="rank 7 is not connected"):
        scheduler.send(7, Go(), step=1)


def test_a_connection_that_has_not_said_hello_cannot_be_sent_to(scheduler: SchedulerEndpoint) -> None:
    with executor(scheduler.address, rank=1):
        with pytest.raises(TransportError, match="rank 1 is not connected"):
            scheduler.send(1, Go(), step=1)


def received_error(scheduler: SchedulerEndpoint, peer: RawPeer, parts: list[bytes]) -> ProtocolError:
    peer.send(parts)
    got = scheduler.recv(TIMEOUT_MS)
    assert got is not None and got.frame is None and got.rank == 0
    return got.error


def test_a_wrong_mac_from_a_ranks_connection_is_counted_and_ignored(scheduler: SchedulerEndpoint, rank0: RawPeer) -> None:
    rank0.send(encode(Frame(V, 1, RUN_ID, 1, 10**18, Ready(0)), bytes(32)))
    assert scheduler.recv(300) is None
    assert scheduler.peer_stats().unauthenticated_frames == 1
    rank0.send(rank0.frame(Ready(0)))  # the forged seq did not move the replay count
    assert scheduler.recv(TIMEOUT_MS).frame.body == Ready(0)


def test_an_authenticated_frame_that_fails_decoding_is_the_ranks_error(scheduler: SchedulerEndpoint, rank0: RawPeer) -> None:
    parts = [b"\xc1", b"", frame_mac(KEY, [b"\xc1", b""])]  # 0xc1 is never valid msgpack
    assert received_error(scheduler, rank0, parts).code == RejectCode.MALFORMED


def test_the_transport_leaves_the_envelope_to_the_conversation(scheduler: SchedulerEndpoint, rank0: RawPeer) -> None:
    # Version, layout and run id are judged against the negotiated ones by protocol.conversation.
    rank0.send(rank0.frame(Ready(0), version=V + 1, run_id="another-run"))
    got = scheduler.recv(TIMEOUT_MS)
    assert (got.frame.version, got.frame.run_id) == (V + 1, "another-run")


def test_replayed_frame_is_refused(scheduler: SchedulerEndpoint, rank0: RawPeer) -> None:
    parts = rank0.frame(Ready(0))
    rank0.send(parts)
    assert scheduler.recv(TIMEOUT_MS).error is None
    assert received_error(scheduler, rank0, parts).code == RejectCode.REPLAY
    older = rank0.frame(Ready(0), seq=rank0.seq - 5)
    assert received_error(scheduler, rank0, older).code == RejectCode.REPLAY


def test_executor_raises_on_a_bad_frame_and_keeps_working() -> None:
    address = ipc_address()
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    try:
        with executor(address, rank=2) as ex:
            ex.send(Ready(2), step=0)
            identity = router.recv_multipart()[0]
            assert identity.startswith(b"\0")  # made by the ROUTER: executors choose none
            router.send_multipart([identity, to_message([b"garbage", b"", b"x" * 32])])
            with pytest.raises(ProtocolError) as info:
                ex.recv(TIMEOUT_MS)
            assert info.value.code == RejectCode.BAD_MAC
            router.send_multipart([identity, to_message(encode(Frame(V, 1, RUN_ID, 1, 1, Go()), KEY))])
            assert ex.recv(TIMEOUT_MS).body == Go()
    finally:
        router.close()
        context.term()
        os.remove(address.removeprefix("ipc://"))
        os.rmdir(os.path.dirname(address.removeprefix("ipc://")))


def test_a_recv_that_does_not_wait_reads_what_is_queued_and_leaves_a_wake_for_the_next_wait(
    scheduler: SchedulerEndpoint, rank0: RawPeer
) -> None:
    """recv(0) answers from the socket's own flags (no poller): a queued frame comes back, an empty
    socket gives None at once, and a wake() it did not consume still ends the next wait at once."""
    assert scheduler.recv(0) is None
    rank0.send(rank0.frame(Ready(0)))
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    got = None
    while got is None and time.monotonic() < deadline:
        got = scheduler.recv(0)  # the frame arrives on ZeroMQ's I/O thread, in its own time
    assert got is not None and got.rank == 0 and got.frame.body == Ready(0)
    assert scheduler.recv(0) is None
    scheduler.wake()
    assert scheduler.recv(0) is None
    started = time.monotonic()
    assert scheduler.recv(TIMEOUT_MS) is None
    assert time.monotonic() - started < TIMEOUT_MS / 2000


def test_a_short_wait_lasts_its_whole_time_and_is_not_cut_to_a_poll(scheduler: SchedulerEndpoint) -> None:
    """A 1 ms wait truncated to whole milliseconds after a few microseconds became a poll that
    returns at once, and the engine loop spun until its next duty. Only a lower bound is checked:
    a loaded machine may make any wait longer, never shorter."""
    for timeout_ms in (1, 2, 3):
        started = time.monotonic()
        assert scheduler.recv(timeout_ms) is None
        assert time.monotonic() - started >= timeout_ms / 1000
