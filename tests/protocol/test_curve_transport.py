"""CurveZMQ on tcp://127.0.0.1 in one process: a scheduler and an executor with keys from the
operator's key directories talk; a client with an unknown key, without CURVE, or pinning another
server key gets nothing through and does not disturb the real one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import zmq

from protocol.conversation import StepDone
from protocol.curve import ClientCurve, LaunchKeys, load_keys, write_key_directories
from protocol.errors import TransportError
from protocol.frames import Ready
from protocol.transport import ExecutorEndpoint, SchedulerEndpoint
from tests.protocol.conversation_helpers import hello
from tests.protocol.test_frame_socket_peers import settle
from tests.protocol.wire_peers import SchedulerDriver, run_executor
from tests.protocol.wire_samples import GEOMETRY, RUN_ID, valid_prepare


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, LaunchKeys]:
    root = Path(tmp_path_factory.mktemp("keys")) / "launch"
    dirs = write_key_directories(root, ["head", "worker"], scheduler_host="head")
    return {host: load_keys(d) for host, d in dirs.items()}


@pytest.fixture
def scheduler(keys) -> Iterator[SchedulerEndpoint]:
    endpoint = SchedulerEndpoint("tcp://127.0.0.1:0", keys["head"].frame_key, RUN_ID, curve=keys["head"].server)
    yield endpoint
    endpoint.close()


def test_a_curve_pair_talks_and_runs_steps(keys, scheduler: SchedulerEndpoint) -> None:
    threads = [
        threading.Thread(
            target=run_executor,
            args=(scheduler.address, keys[host].frame_key, RUN_ID, rank, 2, GEOMETRY, keys[host].client),
            daemon=True,
        )
        for rank, host in enumerate(["head", "worker"])
    ]
    for t in threads:
        t.start()
    driver = SchedulerDriver(scheduler, 2, RUN_ID)
    driver.handshake()
    assert isinstance(driver.step(valid_prepare()), StepDone)
    driver.shutdown("test over")
    for t in threads:
        t.join(timeout=10)
    assert scheduler.peer_stats().handshake_failures == 0


def intruder_curves(keys) -> dict[str, ClientCurve | None]:
    public, secret = zmq.curve_keypair()
    worker = keys["worker"].client
    other_server, _ = zmq.curve_keypair()
    return {
        "unknown client key": ClientCurve(public, secret, worker.server_key),
        "no CURVE": None,
        "another server key pinned": replace(worker, server_key=other_server),
    }


@pytest.mark.parametrize("kind", ["unknown client key", "no CURVE", "another server key pinned"])
def test_a_peer_without_an_admitted_key_gets_nothing_through(keys, scheduler: SchedulerEndpoint, kind: str) -> None:
    real = ExecutorEndpoint(scheduler.address, keys["worker"].frame_key, RUN_ID, 0, curve=keys["worker"].client)
    # The intruder even holds the frame key: without an admitted CURVE key it still cannot talk.
    intruder = ExecutorEndpoint(scheduler.address, keys["worker"].frame_key, RUN_ID, 1, curve=intruder_curves(keys)[kind])
    try:
        intruder.send(hello(1), step=0)
        real.send(hello(0), step=0)
        got = scheduler.recv(5000)
        assert got is not None and got.rank == 0
        real.send(Ready(0), step=1)
        got = scheduler.recv(5000)
        assert got is not None and got.rank == 0 and got.frame.body == Ready(0)
        if kind != "another server key pinned":  # that client gives up on its own side of the handshake
            settle(scheduler, lambda: scheduler.peer_stats().handshake_failures >= 1)
        assert scheduler.recv(300) is None and scheduler.ranks == {0}
        if kind == "no CURVE":
            assert intruder.recv(300) is None  # nothing reaches it
        else:  # a rank with the wrong keys hears why at once, instead of waiting for a WELCOME
            with pytest.raises(TransportError, match="cannot reach the scheduler.*tp-runtime keys"):
                for _ in range(20):
                    intruder.recv(100)
        assert scheduler.disconnected_ranks() == []
    finally:
        intruder.close()
        real.close()


def test_without_admitted_keys_nobody_is_admitted(keys) -> None:
    nobody = replace(keys["head"].server, allowed_clients=frozenset())
    with SchedulerEndpoint("tcp://127.0.0.1:0", keys["head"].frame_key, RUN_ID, curve=nobody) as scheduler:
        with ExecutorEndpoint(scheduler.address, keys["head"].frame_key, RUN_ID, 0, curve=keys["head"].client) as ex:
            ex.send(hello(0), step=0)
            settle(scheduler, lambda: scheduler.peer_stats().handshake_failures >= 1)
            assert scheduler.ranks == frozenset()
