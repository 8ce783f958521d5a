"""The step protocol between real processes over ipc://, both sides driven by protocol.conversation:
PREPARE to every rank, READY back, GO, RESULT and DONE back; and a REJECT from one rank that ends the
step in ABORT, after which the next step runs."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest

from protocol.conversation import StepDone, StepRefused
from protocol.errors import RejectCode
from protocol.transport import SchedulerEndpoint, ipc_address
from tests.protocol.wire_peers import SchedulerDriver, run_executor
from tests.protocol.wire_samples import GEOMETRY, KEY, RUN_ID, valid_prepare, with_arrays

WORLD = 3


@pytest.fixture
def cluster() -> Iterator[SchedulerDriver]:
    ctx = multiprocessing.get_context("spawn")
    endpoint = SchedulerEndpoint(ipc_address(), KEY, RUN_ID)
    procs = [
        ctx.Process(target=run_executor, args=(endpoint.address, KEY, RUN_ID, rank, WORLD, GEOMETRY), daemon=True)
        for rank in range(WORLD)
    ]
    try:
        for p in procs:
            p.start()
        driver = SchedulerDriver(endpoint, WORLD, RUN_ID)
        welcome = driver.handshake()
        assert [h.rank for h in welcome.hellos] == list(range(WORLD)) and welcome.geometry == GEOMETRY
        yield driver
        driver.shutdown("test over")
        for p in procs:
            p.join(timeout=20)
        assert [p.exitcode for p in procs] == [0] * WORLD
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        endpoint.close()


def test_prepare_ready_go_done_across_processes(cluster: SchedulerDriver) -> None:
    for step in (1, 2, 3):
        prepare = valid_prepare(seed=step)
        done = cluster.step(prepare)
        assert isinstance(done, StepDone) and done.step == step
        assert done.result.seq_ids.tolist() == prepare.seq_ids.tolist()


def test_a_reject_ends_the_step_in_abort_and_the_next_step_runs(cluster: SchedulerDriver) -> None:
    assert isinstance(cluster.step(valid_prepare(seed=1)), StepDone)
    good = valid_prepare(seed=2)
    bad = with_arrays(good, cleared_pages=[7, 8, GEOMETRY.num_kv_pages + 3])
    step = cluster.conv.next_step
    cluster.conv.prepare(step, good)  # the conversation's bookkeeping; the frames differ per rank
    cluster.endpoint.send(0, good, step)
    cluster.endpoint.send(1, good, step)
    cluster.endpoint.send(2, bad, step)
    refused = cluster.expect(StepRefused)
    assert [(r.rank, r.code) for r in refused.rejections] == [(2, RejectCode.PAGE_OUT_OF_RANGE)]
    assert str(GEOMETRY.num_kv_pages + 3) in refused.message and refused.seq_ids == ()
    cluster.endpoint.send_all(cluster.conv.ranks, *cluster.conv.abort(step, refused.message))
    assert isinstance(cluster.step(valid_prepare(seed=3)), StepDone)


def test_a_bad_sampling_parameter_names_only_its_sequence(cluster: SchedulerDriver) -> None:
    good = valid_prepare(seed=4)
    bad_temperature = good.temperature.copy()
    bad_temperature[2] = 1e-40  # a float32 denormal: the sampler's division would overflow
    refused = cluster.step(with_arrays(good, temperature=bad_temperature))
    assert isinstance(refused, StepRefused) and len(refused.rejections) == WORLD
    assert refused.seq_ids == (int(good.seq_ids[2]),)
    assert all(r.code == RejectCode.BAD_SAMPLING for r in refused.rejections)
    assert isinstance(cluster.step(good), StepDone)
