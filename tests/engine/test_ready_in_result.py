"""The engine's step loop with a lone rank whose READY rides in the RESULT of the step before
(protocol 8): the step is GOed from that RESULT and the next one planned at once, a READY that
rides is not late however long the step before it runs, and a READY that never comes is still
caught ready_s after that step's RESULT, as a READY of its own is after its PREPARE."""

from __future__ import annotations

import dataclasses
import time
from collections import deque

import pytest

from protocol.conversation import ExecutorConversation, PrepareReceived
from protocol.frames import Abort, Frame
from protocol.transport.scheduler_endpoint import Received
from scheduler.request import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.protocol.conversation_helpers import RUN_ID, V, frame, running_scheduler, welcomed_executor
from tests.protocol.wire_samples import GEOMETRY
from tests.server.fake_rank import fake_result
from tp_runtime.step_loop import EngineTimeouts, StepLoop

READY_S = 0.5


class Wire:
    """The scheduler endpoint's side the step loop uses, with the rank's frames queued by the test."""

    run_id = RUN_ID

    def __init__(self) -> None:
        self.sent: list[tuple[object, int]] = []
        self.inbox: deque[Received] = deque()
        self.waits: list[int] = []  # the timeout of each recv that found nothing

    def send_all(self, ranks: tuple[int, ...], body: object, step: int) -> None:
        self.sent.append((body, step))

    def recv(self, timeout_ms: int) -> Received | None:
        if self.inbox:
            return self.inbox.popleft()
        self.waits.append(timeout_ms)
        return None

    def disconnected_ranks(self) -> list[int]:
        return []


class LoneRank:
    """Rank 0's conversation, fed what the loop sent; it answers as executor/link.py does."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.conv: ExecutorConversation = welcomed_executor(0, 1, ready_is_go=True)
        self.held: dict[int, object] = {}
        self.read = 0
        self.said: list[tuple[str, int]] = []

    def take_frames(self) -> list[int]:
        """Every PREPARE/CONTINUE sent since the last call, answered: the steps received."""
        steps = []
        for body, step in self.wire.sent[self.read :]:
            for event in self.conv.receive(frame(body, step)):
                assert isinstance(event, PrepareReceived), event
                self.held[step] = event.prepare
                ready = self.conv.ready_or_ride(step)
                if ready is not None:
                    self.send(*ready)
                steps.append(step)
        self.read = len(self.wire.sent)
        return steps

    def result(self, step: int, drop_ready: bool = False) -> None:
        body, _ = self.conv.result(step, fake_result(self.held.pop(step), 7))
        if drop_ready:  # the READY that rode is lost: the RESULT goes without it
            body = dataclasses.replace(body, ready_next=False)
        self.send(body, step)

    def send(self, body: object, step: int) -> None:
        self.said.append((type(body).__name__, step))
        self.wire.inbox.append(Received(0, Frame(V, 1, RUN_ID, step, 0, body), None))


def lone_rank_loop(timeouts: EngineTimeouts = EngineTimeouts(ready_s=READY_S, heartbeat_s=float("inf"))) -> tuple[StepLoop, Wire, LoneRank]:
    config = SchedulerConfig(
        num_kv_pages=GEOMETRY.num_kv_pages, page_size=GEOMETRY.page_size, max_num_seqs=4,
        max_num_batched_tokens=64, max_model_len=256, max_inflight_steps=2,
    )  # fmt: skip
    wire = Wire()
    loop = StepLoop(
        scheduler=Scheduler(config), endpoint=wire, world_size=1, timeouts=timeouts,  # type: ignore[arg-type]
        deliver=lambda outputs: None, on_scheduled=lambda plan: None,
    )  # fmt: skip
    loop.conversation = running_scheduler(world=1, max_inflight=2, ready_is_go=True)
    # Welcomed now, so that no rank is silent while a test runs; the tests run the deadline checks
    # themselves (and, by default, no heartbeat is due).
    loop._welcomed_at = time.monotonic()
    loop.scheduler.add_request(1, [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    return loop, wire, LoneRank(wire)


def test_a_ready_in_the_result_before_goes_the_step_and_is_never_late_while_that_step_runs() -> None:
    loop, wire, rank = lone_rank_loop()
    conv = loop.conversation
    loop.iterate(0)
    assert rank.take_frames() == [1]  # nothing ran there: READY of its own
    loop.iterate(0)  # READY 1 -> the step runs; step 2 is planned while it does
    assert rank.take_frames() == [2] and conv.unanswered(2) == frozenset({0})
    # Step 1 runs far past ready_s: step 2's READY is not late, it rides in step 1's RESULT.
    loop._check_deadlines(time.monotonic() + 20 * READY_S)
    assert loop.counters.aborts == 0 and conv.staged == 2
    rank.result(1)
    loop.iterate(0)  # RESULT 1 says READY 2: GO 2, and step 3 planned at once
    assert conv.in_flight == (2, 3) and conv.staged == 3 and loop.counters.aborts == 0
    assert rank.take_frames() == [3] and rank.conv.running == (2, 3)
    assert rank.said == [("Ready", 1), ("Result", 1)]  # two steps GOed, one READY frame


def test_a_ready_that_never_comes_is_caught_ready_s_after_the_result_before() -> None:
    loop, wire, rank = lone_rank_loop()
    conv = loop.conversation
    loop.iterate(0)
    rank.take_frames()
    loop.iterate(0)
    rank.take_frames()  # step 2's READY rides on step 1's RESULT ...
    loop._inflight[2].sent_at -= 20 * READY_S  # (step 1 ran long after step 2 was sent)
    rank.result(1, drop_ready=True)  # ... which goes without it
    loop.iterate(0)
    finished = loop._finished_at
    assert conv.staged == 2 and conv.unanswered(2) == frozenset({0})
    loop._check_deadlines(finished + READY_S / 2)
    assert loop.counters.aborts == 0
    loop._check_deadlines(finished + 2 * READY_S)
    assert loop.counters.aborts == 1 and conv.in_flight == ()
    body, step = wire.sent[-1]
    assert isinstance(body, Abort) and step == 2 and "did not answer READY" in body.reason


def test_a_protocol_violation_while_a_ready_may_ride_fails_the_group_instead_of_aborting() -> None:
    """The lone rank may be running the step whose READY rides: an ABORT could not stop it."""
    from protocol.conversation import ProtocolViolation
    from protocol.errors import RejectCode
    from tp_runtime.step_loop import RankFailure

    loop, wire, rank = lone_rank_loop()
    loop.iterate(0)
    rank.take_frames()
    loop.iterate(0)
    rank.take_frames()  # step 2's READY rides on step 1's RESULT
    violation = ProtocolViolation(0, "host-0", None, RejectCode.MALFORMED, "a frame that broke the rules")
    with pytest.raises(RankFailure, match="broke the protocol with steps running"):
        loop._on_event(violation)
    assert loop.counters.aborts == 0
