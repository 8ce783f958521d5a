"""The step protocol between real processes over ipc://: PREPARE to every rank, READY back, GO, DONE
back; and a REJECT from one rank that ends the step in ABORT, after which the next step runs."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest

from protocol.errors import RejectCode
from protocol.frames import LAYOUT_VERSION, PROTOCOL_VERSION, Abort, Done, Frame, Go, Hello, Ready, Reject, Shutdown, Welcome
from protocol.transport import Received, SchedulerEndpoint, ipc_address
from tests.protocol.wire_peers import run_executor
from tests.protocol.wire_samples import GEOMETRY, KEY, RUN_ID, valid_prepare, with_arrays

WORLD = 3
TIMEOUT_MS = 20_000


@pytest.fixture
def cluster() -> Iterator[SchedulerEndpoint]:
    ctx = multiprocessing.get_context("spawn")
    scheduler = SchedulerEndpoint(ipc_address(), KEY, RUN_ID)
    procs = [
        ctx.Process(target=run_executor, args=(scheduler.address, KEY, RUN_ID, rank, WORLD, GEOMETRY), daemon=True)
        for rank in range(WORLD)
    ]
    try:
        for p in procs:
            p.start()
        hellos = collect(scheduler, Hello)
        assert sorted(hellos) == list(range(WORLD))
        scheduler.send_all(range(WORLD), Welcome(PROTOCOL_VERSION, LAYOUT_VERSION, WORLD, GEOMETRY), step=0)
        yield scheduler
        scheduler.send_all(range(WORLD), Shutdown("test over"), step=0)
        for p in procs:
            p.join(timeout=20)
        assert [p.exitcode for p in procs] == [0] * WORLD
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        scheduler.close()


def collect(scheduler: SchedulerEndpoint, *kinds: type) -> dict[int, Frame]:
    """One frame from every rank; each must be one of `kinds` and decode cleanly."""
    got: dict[int, Frame] = {}
    while len(got) < WORLD:
        received: Received | None = scheduler.recv(TIMEOUT_MS)
        assert received is not None, f"no answer from ranks {sorted(set(range(WORLD)) - set(got))}"
        assert received.error is None, str(received.error)
        assert isinstance(received.frame.body, kinds), received.frame.body
        assert received.rank not in got
        got[received.rank] = received.frame
    return got


def run_step(scheduler: SchedulerEndpoint, step: int, seed: int) -> None:
    scheduler.send_all(range(WORLD), valid_prepare(seed=seed), step=step)
    ready = collect(scheduler, Ready)
    assert {r: (f.step, f.body.rank) for r, f in ready.items()} == {r: (step, r) for r in range(WORLD)}
    scheduler.send_all(range(WORLD), Go(), step=step)
    done = collect(scheduler, Done)
    assert all(f.step == step for f in done.values())


def test_prepare_ready_go_done_across_processes(cluster: SchedulerEndpoint) -> None:
    for step in (1, 2, 3):
        run_step(cluster, step, seed=step)


def test_a_reject_ends_the_step_in_abort_and_the_next_step_runs(cluster: SchedulerEndpoint) -> None:
    run_step(cluster, 1, seed=1)
    good = valid_prepare(seed=2)
    bad = with_arrays(good, cleared_pages=[7, 8, GEOMETRY.num_kv_pages + 3])
    cluster.send(0, good, step=2)
    cluster.send(1, good, step=2)
    cluster.send(2, bad, step=2)
    answers = collect(cluster, Ready, Reject)
    assert [type(answers[r].body) for r in range(WORLD)] == [Ready, Ready, Reject]
    reject = answers[2].body
    assert reject.code == RejectCode.PAGE_OUT_OF_RANGE and str(GEOMETRY.num_kv_pages + 3) in reject.message
    cluster.send_all(range(WORLD), Abort("rank 2 rejected step 2"), step=2)
    run_step(cluster, 3, seed=3)
