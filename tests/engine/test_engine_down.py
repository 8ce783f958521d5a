"""Engine.wait_down: what the frontend's main thread sleeps on until the runtime fails or stops,
instead of looking five times a second."""

from __future__ import annotations

import threading

import pytest

from protocol.auth import new_key
from protocol.transport import SchedulerEndpoint, ipc_address
from scheduler.scheduler import Scheduler, SchedulerConfig
from tp_runtime.engine import Engine
from tp_runtime.step_loop import EngineTimeouts


def _engine(timeouts: EngineTimeouts = EngineTimeouts()) -> Engine:
    """An engine of one rank that never says HELLO."""
    endpoint = SchedulerEndpoint(ipc_address(), new_key(), "run-under-test")
    scheduler = Scheduler(
        SchedulerConfig(num_kv_pages=32, page_size=16, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    )
    return Engine(scheduler=scheduler, endpoint=endpoint, world_size=1, model_name="tiny", max_model_len=256, timeouts=timeouts)


@pytest.fixture
def engine():
    engine = _engine()
    try:
        yield engine
    finally:
        engine.shutdown()
        engine.close()


def test_a_failure_from_another_thread_wakes_the_waiter(engine):
    assert not engine.wait_down(0)
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: engine.wait_down() and woke.set())
    waiter.start()
    try:
        engine.fail("the launcher saw a rank die")
        assert woke.wait(10)
    finally:
        waiter.join(10)
    assert engine.failed


def test_the_engine_is_down_once_its_thread_ends_by_itself():
    # The handshake times out and the engine thread ends on its own, with nobody calling fail()
    # or shutdown().
    engine = _engine(EngineTimeouts(handshake_s=0.2))
    try:
        engine.start()
        assert engine.wait_down(30)
        assert engine.failed and "HELLO" in engine.health().reason
        engine._thread.join(10)
        assert not engine._thread.is_alive()
    finally:
        engine.shutdown()
        engine.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's end, as meant
def test_a_clean_up_that_fails_still_leaves_the_engine_down(monkeypatch):
    # The engine thread's last words (failing the streams, a stats snapshot, telling the ranks)
    # may themselves raise after a loop that failed on bad state: the frontend must not wait on.
    engine = _engine(EngineTimeouts(handshake_s=0.2))

    def broken(*args, **kwargs):
        raise RuntimeError("the stats walk met a broken scheduler")

    monkeypatch.setattr(engine, "_make_stats", broken)
    try:
        engine.start()
        assert engine.wait_down(30)
    finally:
        engine._thread.join(10)
        engine.close()


def test_a_shutdown_before_the_thread_started_is_down_too(engine):
    engine.shutdown("never started")
    assert engine.wait_down(0)
