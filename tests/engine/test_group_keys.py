"""Each executor group's keys across hosts, and which rank takes the bootstrap from the frontend
(tp_runtime.frame_keys.group_frame_key, tp_runtime.group_endpoints, tp_runtime.bootstrap)."""

from __future__ import annotations

import multiprocessing
import os
import socket
from pathlib import Path

import pytest
import zmq

from protocol.auth import new_key
from tp_runtime import frame_keys
from tp_runtime.bootstrap import BootstrapRequest, KeyMode
from tp_runtime.config import RuntimeConfig
from tp_runtime.group_endpoints import open_group


def test_both_sides_derive_the_same_group_key_and_each_run_id_its_own() -> None:
    directory_key = new_key()
    key = frame_keys.group_frame_key(directory_key, "run-a")
    assert len(key) == 32 and key != directory_key
    assert frame_keys.group_frame_key(directory_key, "run-a") == key  # the frontend's and a rank's
    assert frame_keys.group_frame_key(directory_key, "run-b") != key
    assert frame_keys.group_frame_key(new_key(), "run-a") != key


def test_a_directory_group_signs_with_its_derived_key_and_tells_no_key(tmp_path: Path) -> None:
    dirs = frame_keys.create_key_dirs(str(tmp_path / "keys"), ["a", "b"])
    config = RuntimeConfig(model="m", tensor_parallel_size=2, nnodes=2, frame_key_dir=str(dirs["a"]))
    groups = [open_group(config, "tcp://127.0.0.1:0") for _ in range(2)]
    try:
        directory_key = frame_keys.load_key_dir(str(dirs["b"])).frame_key  # another host's copy
        for group in groups:
            told = group.answer(BootstrapRequest(0), 2)
            assert told.key_mode == KeyMode.DIRECTORY and not told.key_hex and not told.sealed_keys
            assert group.key == frame_keys.group_frame_key(directory_key, told.run_id)
        assert groups[0].bootstrap.run_id != groups[1].bootstrap.run_id and groups[0].key != groups[1].key
    finally:
        for group in groups:
            group.endpoint.close()


def test_with_keys_through_the_store_the_request_s_keys_are_admitted_and_sealed_to() -> None:
    pytest.importorskip("cryptography")
    config = RuntimeConfig(model="m", tensor_parallel_size=2, nnodes=2, trust_rendezvous_store=True)
    ranks = [frame_keys.new_pair(), frame_keys.new_pair()]
    group = open_group(config, "tcp://127.0.0.1:0")
    try:
        assert "1 executor keys for 2 ranks" in group.answer(BootstrapRequest(0, (ranks[0].public.decode(),)), 2).error
        told = group.answer(BootstrapRequest(0, tuple(pair.public.decode() for pair in ranks)), 2)
        assert told.key_mode == KeyMode.STORE and not told.key_hex
        for rank, pair in enumerate(ranks):
            opened = frame_keys.open_frame_key(bytes.fromhex(told.sealed_keys[rank]), pair, told.server_key.encode(), told.run_id, rank)
            assert opened == group.key
        assert _curve_handshake(group.endpoint.address, ranks[1], told.server_key.encode())
        assert not _curve_handshake(group.endpoint.address, frame_keys.new_pair(), told.server_key.encode())
    finally:
        group.endpoint.close()


def _curve_handshake(address: str, pair: frame_keys.CurvePair, server_key: bytes) -> bool:
    """Whether a CURVE client with `pair` completes the handshake with the server at `address`."""
    from zmq.utils.monitor import recv_monitor_message

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = pair.public, pair.secret, server_key
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        sock.connect(address)
        if not monitor.poll(10_000):
            raise AssertionError("no CURVE handshake outcome within 10 s")
        return recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()
        context.term()


ASKING = ((False, True), (True, True), (False, False))  # whether rank 0, rank 1 can reach the frontend


def _votes(rank: int, port: int, out: multiprocessing.Queue) -> None:
    import torch.distributed as dist

    from tp_runtime.bootstrap import bootstrap_source, broadcast_bytes

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for asking in ASKING:
            source = bootstrap_source(asking[rank], rank, 2, None)
            payload = broadcast_bytes(f"from rank {rank}".encode() if rank == source else b"", None, source)
            out.put((asking, rank, source, payload.decode()))
    finally:
        dist.destroy_process_group()


def test_the_bootstrap_comes_from_the_lowest_rank_that_can_ask() -> None:
    """Global rank 0 may be on a host without the frontend (c10d numbers hosts by address): the
    first rank that reaches the bootstrap socket is the source; rank 0 where none does."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    procs: list[multiprocessing.process.BaseProcess] = []
    try:
        procs = [context.Process(target=_votes, args=(rank, port, out)) for rank in range(2)]
        for proc in procs:
            proc.start()
        results = sorted(out.get(timeout=120) for _ in range(2 * len(ASKING)))
        for proc in procs:
            proc.join(30)
            assert proc.exitcode == 0
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    expected = []
    for asking in ASKING:
        source = asking.index(True) if any(asking) else 0
        expected += [(asking, rank, source, f"from rank {source}") for rank in range(2)]
    assert results == sorted(expected)
