"""Endpoints in one process: addresses, checks on receive, reliable sends, clean close."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

import pytest
import zmq

from protocol.codec import encode
from protocol.errors import ProtocolError, RejectCode, TransportError
from protocol.frames import PROTOCOL_VERSION as V
from protocol.frames import SUPPORTED_VERSIONS, Frame, Go, Hello, Ready
from protocol.transport import ExecutorEndpoint, SchedulerEndpoint, identity_of, ipc_address
from tests.protocol.wire_samples import GEOMETRY, KEY, RUN_ID, valid_prepare

TIMEOUT_MS = 2000


@pytest.fixture
def scheduler() -> Iterator[SchedulerEndpoint]:
    endpoint = SchedulerEndpoint(ipc_address(), KEY, RUN_ID)
    yield endpoint
    endpoint.close()


@pytest.fixture
def raw_dealer(scheduler: SchedulerEndpoint) -> Iterator[zmq.Socket]:
    """A peer that sends whatever parts a test wants, as rank 0."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity_of(0))
    sock.connect(scheduler.address)
    yield sock
    sock.close()
    context.term()


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
        ex.send(Ready(0), step=1)
        got = sched.recv(TIMEOUT_MS)
        assert got is not None and got.rank == 0 and got.error is None and got.frame.body == Ready(0)


def test_round_trip_stamps_the_envelope(scheduler: SchedulerEndpoint) -> None:
    with executor(scheduler.address, rank=3) as ex:
        ex.send(Hello(3, 4, SUPPORTED_VERSIONS, 1, "fp", GEOMETRY), step=0)
        got = scheduler.recv(TIMEOUT_MS)
        assert got.rank == 3 and got.error is None
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
            peer.send(Ready(rank), step=0)
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


def received_error(scheduler: SchedulerEndpoint, sock: zmq.Socket, parts: list[bytes]) -> ProtocolError:
    sock.send_multipart(parts)
    got = scheduler.recv(TIMEOUT_MS)
    assert got is not None and got.frame is None
    return got.error


def test_wrong_mac_is_reported_not_raised(scheduler: SchedulerEndpoint, raw_dealer: zmq.Socket) -> None:
    parts = encode(Frame(V, 1, RUN_ID, 1, 1, Ready(0)), bytes(32))
    assert received_error(scheduler, raw_dealer, parts).code == RejectCode.BAD_MAC


def test_other_run_id_is_refused(scheduler: SchedulerEndpoint, raw_dealer: zmq.Socket) -> None:
    parts = encode(Frame(V, 1, "another-run", 1, 1, Ready(0)), KEY)
    error = received_error(scheduler, raw_dealer, parts)
    assert error.code == RejectCode.BAD_RUN_ID and "another-run" in error.message


def test_other_version_is_refused_except_in_the_handshake(scheduler: SchedulerEndpoint, raw_dealer: zmq.Socket) -> None:
    error = received_error(scheduler, raw_dealer, encode(Frame(V + 1, 1, RUN_ID, 1, 1, Ready(0)), KEY))
    assert error.code == RejectCode.BAD_VERSION and f"version {V + 1}" in error.message
    # HELLO at a version this side does not support is refused too, naming what it supports.
    error = received_error(scheduler, raw_dealer, encode(Frame(9, 1, RUN_ID, 0, 2, Hello(0, 1, (9,), 1, "", GEOMETRY)), KEY))
    assert error.code == RejectCode.BAD_VERSION and f"supports {list(SUPPORTED_VERSIONS)}" in error.message


def test_replayed_frame_is_refused(scheduler: SchedulerEndpoint, raw_dealer: zmq.Socket) -> None:
    parts = encode(Frame(V, 1, RUN_ID, 1, 100, Ready(0)), KEY)
    raw_dealer.send_multipart(parts)
    assert scheduler.recv(TIMEOUT_MS).error is None
    assert received_error(scheduler, raw_dealer, parts).code == RejectCode.REPLAY
    older = encode(Frame(V, 1, RUN_ID, 1, 99, Ready(0)), KEY)
    assert received_error(scheduler, raw_dealer, older).code == RejectCode.REPLAY


def test_a_refused_frame_does_not_advance_the_replay_count(scheduler: SchedulerEndpoint, raw_dealer: zmq.Socket) -> None:
    forged = encode(Frame(V, 1, RUN_ID, 1, 10**18, Ready(0)), bytes(32))
    assert received_error(scheduler, raw_dealer, forged).code == RejectCode.BAD_MAC
    raw_dealer.send_multipart(encode(Frame(V, 1, RUN_ID, 1, 5, Ready(0)), KEY))
    assert scheduler.recv(TIMEOUT_MS).error is None


def test_unknown_identity_is_reported_as_rank_minus_one(scheduler: SchedulerEndpoint) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"intruder")
    sock.connect(scheduler.address)
    try:
        sock.send_multipart(encode(Frame(V, 1, RUN_ID, 1, 1, Ready(0)), KEY))
        got = scheduler.recv(TIMEOUT_MS)
        assert got.rank == -1 and got.error.code == RejectCode.MALFORMED
    finally:
        sock.close()
        context.term()


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
            assert identity == b"rank-2"
            router.send_multipart([identity, b"garbage", b"x" * 32])
            with pytest.raises(ProtocolError) as info:
                ex.recv(TIMEOUT_MS)
            assert info.value.code == RejectCode.BAD_MAC
            router.send_multipart([identity, *encode(Frame(V, 1, RUN_ID, 1, 1, Go()), KEY)])
            assert ex.recv(TIMEOUT_MS).body == Go()
    finally:
        router.close()
        context.term()
        os.remove(address.removeprefix("ipc://"))
        os.rmdir(os.path.dirname(address.removeprefix("ipc://")))
