"""The engine refuses a launch whose ranks disagree, with a sentence naming the difference, and
tells every rank to shut down; a matching launch is welcomed with rank 0's geometry."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from protocol.auth import new_key
from protocol.frames import LAYOUT_VERSION, SUPPORTED_VERSIONS, CacheGeometry, Hello, Shutdown, Welcome
from protocol.transport import ExecutorEndpoint, SchedulerEndpoint, ipc_address
from scheduler.scheduler import Scheduler, SchedulerConfig
from tp_runtime.engine import Engine, EngineTimeouts, EngineUnavailable

GEOMETRY = CacheGeometry(
    num_kv_pages=32, page_size=16, num_layers=2, num_kv_heads=3, head_dim=8, kv_dtype="fp32",
    vocab_size=512, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
)


def run_handshake(hellos: list[Hello], answers: list[list[object]]) -> None:
    key, run_id = new_key(), "run-under-test"
    endpoint = SchedulerEndpoint(ipc_address(), key, run_id)
    scheduler = Scheduler(
        SchedulerConfig(num_kv_pages=32, page_size=16, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    )
    engine = Engine(
        scheduler=scheduler, endpoint=endpoint, world_size=len(hellos), model_name="tiny", max_model_len=256,
        timeouts=EngineTimeouts(handshake_s=20),
    )
    answers.extend([] for _ in hellos)

    def rank(index: int) -> None:
        peer = ExecutorEndpoint(endpoint.address, key, run_id, index)
        try:
            peer.send(hellos[index], 0)
            while (frame := peer.recv(10_000)) is not None:
                answers[index].append(frame.body)
                if isinstance(frame.body, Shutdown):
                    return
        finally:
            peer.close()

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(hellos))]
    for t in threads:
        t.start()
    engine.start()
    try:
        engine.wait_ready(30)
    finally:
        engine.shutdown("test over")
        for t in threads:
            t.join(timeout=30)
        endpoint.close()


def hello(rank: int, world: int = 2, **changes: object) -> Hello:
    geometry = replace(GEOMETRY, **changes.pop("geometry", {}))
    return Hello(**{"rank": rank, "world_size": world, "versions": SUPPORTED_VERSIONS, "layout": LAYOUT_VERSION,
                    "model_fingerprint": "abc", "geometry": geometry, **changes})


def test_matching_ranks_are_welcomed_with_rank_zeros_geometry() -> None:
    answers: list[list[object]] = []
    run_handshake([hello(0), hello(1)], answers)
    for bodies in answers:
        assert isinstance(bodies[0], Welcome) and bodies[0].geometry == GEOMETRY, bodies


@pytest.mark.parametrize(
    "rank1,needle",
    [
        (hello(1, model_fingerprint="other"), "other weights"),
        (hello(1, geometry={"num_kv_heads": 4}), "cache geometry"),
        (hello(1, world=3), "world size 3"),
        (hello(1, config_fingerprint="f00d", host="node-b"), "rank 1 on host node-b was started with other options"),
    ],
)
def test_ranks_that_disagree_are_refused_with_the_difference(rank1: Hello, needle: str) -> None:
    answers: list[list[object]] = []
    with pytest.raises(EngineUnavailable, match=needle):
        run_handshake([hello(0), rank1], answers)
    assert all(isinstance(b[-1], Shutdown) and not any(isinstance(x, Welcome) for x in b) for b in answers), answers


def test_ranks_whose_cache_differs_from_the_scheduler_plan_are_refused() -> None:
    answers: list[list[object]] = []
    with pytest.raises(EngineUnavailable, match="num_kv_pages 16, the scheduler plans with 32"):
        run_handshake([hello(0, geometry={"num_kv_pages": 16}), hello(1, geometry={"num_kv_pages": 16})], answers)
    assert all(isinstance(b[-1], Shutdown) for b in answers), answers
