"""The frame fuzzer with the key, against two live executors (stand-in model, gloo) driven through
the scheduler's conversation: every mutated PREPARE and every wire case gets the coded REJECT it
must (or no answer, where the protocol ignores the frame), a PREPARE that passes validation runs and
gives a well-formed RESULT, no rank goes down or falls silent, and the good step gives the same
tokens after the fuzzing as before it. The short form; `scripts/stress.py` runs the long one."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from executor.options import ExecutorOptions
from protocol.auth import new_key
from protocol.conversation import StepDone
from protocol.frames import CacheGeometry
from protocol.transport import SchedulerEndpoint, ipc_address
from scripts.harness.executors import ExecutorCluster
from scripts.harness.frame_driver import FrameDriver
from scripts.harness.frame_fuzz import (
    BodyMutation,
    body_mutations,
    check_body_outcome,
    check_good_step,
    check_wire_outcome,
    good_prepare,
    wire_cases,
)

RUN_ID = "frame-fuzz"
WORLD = 2
OPTIONS = ExecutorOptions(
    model="stand-in-v1", num_kv_pages=32, page_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
    kv_cache_dtype="fp32", dtype="fp32", num_host_pages=4, device="cpu", debug_poison_cache=True,
    debug_poison_freed=True, heartbeat_interval_s=0.2, peer_timeout_s=10.0, handshake_timeout_s=120.0,
)  # fmt: skip
# The stand-in samples (last token + 1 + 2) % 64 at TP=2 for each row of the good step.
GOOD_TOKENS = [5 + 3, 7 + 3]

pytestmark = pytest.mark.timeout(240)


@dataclass
class Live:
    driver: FrameDriver
    cluster: ExecutorCluster
    geometry: CacheGeometry

    def assert_up(self) -> None:
        assert self.cluster.survivors() and len(self.cluster.survivors()) == WORLD, "a rank exited"
        assert self.driver.silent_ranks(within_s=3.0) == [], "a rank fell silent"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    logs = tmp_path_factory.mktemp("frame-fuzz")
    endpoint = SchedulerEndpoint(ipc_address(), new_key(), RUN_ID)
    cluster = ExecutorCluster(
        WORLD, address=endpoint.address, key=endpoint._stamp.key, run_id=RUN_ID, options=OPTIONS,
        load="tests.executor.executor_standin:load_standin", log_dir=Path(logs), log_level="ERROR",
    )  # fmt: skip
    try:
        cluster.start()
        driver = FrameDriver(endpoint, WORLD)
        geometry = driver.handshake().geometry
        _, problems = check_good_step(driver.step(good_prepare(geometry)), GOOD_TOKENS)
        assert problems == [], problems
        yield Live(driver, cluster, geometry)
        driver.shutdown("the fuzzing is over")
        assert cluster.stop(grace_s=15) == {0: 0, 1: 0}, "a rank did not exit cleanly at SHUTDOWN"
    finally:
        cluster.stop()
        endpoint.close()


def test_every_wire_case_gets_its_code_and_the_good_step_is_unchanged(live: Live) -> None:
    good = good_prepare(live.geometry)
    failures = {}
    for case in wire_cases(live.geometry):
        sent = live.driver.send_parts(case.build(live.driver, live.driver.next_step, good), answered=case.answered)
        problems = check_wire_outcome(case, sent, WORLD)
        if problems:
            failures[case.name] = problems
    assert failures == {}
    live.assert_up()
    _, problems = check_good_step(live.driver.step(good), GOOD_TOKENS)
    assert problems == []


def test_mutated_prepares_are_refused_with_a_code_or_run_safely(live: Live) -> None:
    outcomes: dict[str, int] = {}

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(mutation=body_mutations(live.geometry))
    def one(mutation: BodyMutation) -> None:
        sent = live.driver.send_parts([live.driver.stamp(mutation.prepare, live.driver.next_step)])
        problems = check_body_outcome(mutation, sent, live.geometry, WORLD)
        assert problems == [], f"{mutation.describe()}: {problems}"
        first = sent.answers[0][0]
        outcomes[first.code.name if first.code else "READY"] = outcomes.get(first.code.name if first.code else "READY", 0) + 1

    one()
    live.assert_up()
    done = live.driver.step(good_prepare(live.geometry))
    assert isinstance(done, StepDone)
    _, problems = check_good_step(done, GOOD_TOKENS)
    assert problems == []
    assert len(outcomes) > 1, f"every mutation got the same answer: {outcomes}"
