"""A group of one rank runs each step on its own READY (WELCOME's ready_is_go): no GO frame either
way, the same step order, results, refusals and failures as with GO, and only for one rank."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from protocol.codec import decode_verified, encode, frame_mac, from_message, to_message, verify
from protocol.conversation import (
    ExecutorConversation,
    GoReceived,
    PrepareReceived,
    ProtocolViolation,
    Refused,
    SchedulerConversation,
    StepDone,
    StepFailed,
    StepReady,
    WelcomeRefused,
)
from protocol.errors import ProtocolError, RejectCode, UsageError
from protocol.frames import LAYOUT_VERSION, Go, Ready, Welcome
from tests.protocol.conversation_helpers import (
    PREPARE,
    V,
    agreed_scheduler,
    frame,
    result,
    running_scheduler,
    welcomed_executor,
)
from tests.protocol.wire_samples import GEOMETRY, RUN_ID

KEY = b"k" * 32


def one_rank() -> tuple[SchedulerConversation, ExecutorConversation]:
    """Both halves of a group of one rank, WELCOMEd with ready_is_go."""
    return running_scheduler(world=1, max_inflight=2, ready_is_go=True), welcomed_executor(0, 1, ready_is_go=True)


def test_the_welcome_carries_ready_is_go_and_the_codec_keeps_it() -> None:
    conv = agreed_scheduler(world=1, max_inflight=2, ready_is_go=True)
    welcome, _ = conv.welcome()
    assert welcome == Welcome(V, LAYOUT_VERSION, 1, GEOMETRY, True)
    for flag in (True, False):
        f = frame(Welcome(V, LAYOUT_VERSION, 1, GEOMETRY, flag))
        assert decoded(encode(f, KEY)).body.ready_is_go is flag


def test_a_ready_is_go_that_is_not_true_or_false_is_malformed() -> None:
    envelope, payload, _ = encode(frame(Welcome(V, LAYOUT_VERSION, 1, GEOMETRY, True)), KEY)
    fields = msgpack.unpackb(envelope)
    fields["body"]["ready_is_go"] = 1
    envelope = msgpack.packb(fields)
    with pytest.raises(ProtocolError, match="ready_is_go must be true or false") as info:
        decoded([envelope, payload, frame_mac(KEY, [envelope, payload])])
    assert info.value.code == RejectCode.MALFORMED


def decoded(sections: list[bytes]):
    return decode_verified(verify(from_message([to_message(sections)]), KEY))


def test_only_a_group_of_one_rank_may_run_on_ready() -> None:
    with pytest.raises(UsageError, match="only in a group of one rank"):
        SchedulerConversation(world_size=2, run_id=RUN_ID, ready_is_go=True)
    conv = ExecutorConversation(rank=0, world_size=2, run_id=RUN_ID, geometry=GEOMETRY, model_fingerprint="w")
    conv.hello()
    (refused,) = conv.receive(frame(Welcome(V, LAYOUT_VERSION, 2, GEOMETRY, True)))
    assert isinstance(refused, WelcomeRefused) and "only a group of one rank" in refused.message


def test_steps_run_on_ready_with_no_go_frame_and_finish_in_order() -> None:
    sched, rank = one_rank()
    for step in (1, 2):
        sched.prepare(step, PREPARE)
        (got,) = rank.receive(frame(PREPARE, step))
        assert isinstance(got, PrepareReceived)
        ready, _ = rank.ready(step)
        assert rank.staged is None and rank.running[-1] == step  # running: nothing waits for a GO
        assert sched.receive(0, frame(ready, step), 1.0) == [StepReady(step)]
        assert sched.go(step) is None  # nothing to send
        assert sched.staged is None  # so the next step may be planned at once
    assert rank.running == (1, 2)
    body, _ = rank.result(1, result())
    (done,) = sched.receive(0, frame(body, 1), 2.0)
    assert isinstance(done, StepDone) and done.step == 1 and sched.in_flight == (2,)
    with pytest.raises(UsageError, match="oldest running step is 2"):
        rank.result(3, result())


def test_a_go_sent_anyway_is_refused_and_a_failed_forward_is_a_failed_step() -> None:
    sched, rank = one_rank()
    sched.prepare(1, PREPARE)
    rank.receive(frame(PREPARE, 1))
    ready, _ = rank.ready(1)
    (refused,) = rank.receive(frame(Go(), 1))
    assert isinstance(refused, Refused) and refused.error.code == RejectCode.UNEXPECTED_FRAME
    sched.receive(0, frame(ready, 1), 1.0)
    sched.go(1)
    reject, _ = rank.reject(1, ProtocolError(RejectCode.INTERNAL, "the forward raised"))
    (failed,) = sched.receive(0, frame(reject, 1), 2.0)
    assert isinstance(failed, StepFailed) and failed.step == 1 and rank.running == ()


def test_a_refused_step_is_aborted_as_with_go() -> None:
    sched, rank = one_rank()
    sched.prepare(1, PREPARE)
    rank.receive(frame(PREPARE, 1))
    reject, _ = rank.reject(1, ProtocolError(RejectCode.PAGE_OUT_OF_RANGE, "page 9999"))
    assert rank.running == ()
    (refused,) = sched.receive(0, frame(reject, 1), 1.0)
    assert refused.step == 1 and sched.staged == 1
    abort, _ = sched.abort(1, "refused")
    (got,) = rank.receive(frame(abort, 1))
    assert got.step == 1 and rank.running == () and sched.in_flight == ()


def test_without_the_flag_a_lone_rank_still_waits_for_go() -> None:
    rank = welcomed_executor(0, 1)
    rank.receive(frame(PREPARE, 1))
    rank.ready(1)
    assert rank.staged == 1 and rank.running == ()
    assert rank.receive(frame(Go(), 1)) == [GoReceived(1)]


def test_a_result_for_a_step_aborted_while_its_ready_crossed_the_abort_breaks_the_protocol() -> None:
    """The one race READY-is-GO opens: the scheduler gave up waiting for READY (ready_s) just as the
    rank sent it and started the step. The step's RESULT then names a step the scheduler dropped: a
    violation (the engine ends the group, recovery replaces it), never a silently accepted result."""
    sched, rank = one_rank()
    sched.prepare(1, PREPARE)
    rank.receive(frame(PREPARE, 1))
    ready, _ = rank.ready(1)
    abort, _ = sched.abort(1, "no READY within 10 s")
    (refused,) = rank.receive(frame(abort, 1))
    assert isinstance(refused, Refused) and "which is running" in refused.error.message
    assert sched.receive(0, frame(ready, 1), 1.0) == []  # a late answer to an aborted step
    body, _ = rank.result(1, result())
    (violation,) = sched.receive(0, frame(body, 1), 2.0)
    assert isinstance(violation, ProtocolViolation)


# ---- READY in the RESULT before (protocol 8) --------------------------------------------------------


def test_a_step_received_while_one_runs_is_answered_in_that_ones_result() -> None:
    sched, rank = one_rank()
    sched.prepare(1, PREPARE)
    rank.receive(frame(PREPARE, 1))
    ready = rank.ready_or_ride(1)  # nothing runs here yet: a READY of its own
    assert ready is not None and sched.receive(0, frame(ready[0], 1), 1.0) == [StepReady(1)]
    sched.go(1)
    sched.prepare(2, PREPARE)
    rank.receive(frame(PREPARE, 2))
    assert rank.ready_or_ride(2) is None and rank.running == (1, 2)
    assert sched.unanswered(2) == frozenset({0})
    body, _ = rank.result(1, result())
    assert body.ready_next
    (done,) = sched.receive(0, frame(encoded_and_back(body), 1), 2.0)
    assert isinstance(done, StepDone) and done.step == 1 and done.next_ready
    assert sched.unanswered(2) == frozenset() and sched.go(2) is None and sched.staged is None
    body, _ = rank.result(2, result())  # nothing rides on the last one
    assert not body.ready_next
    assert sched.receive(0, frame(body, 2), 3.0) == [StepDone(2, body)]


def encoded_and_back(body):
    """The body through the codec: ready_next is a field of the wire, not only of the dataclass."""
    return decoded(encode(frame(body, 1), KEY)).body


@pytest.mark.parametrize("ready_is_go", [True, False])
def test_a_result_may_say_ready_only_for_a_lone_rank_and_the_step_waiting_for_it(ready_is_go: bool) -> None:
    sched = running_scheduler(world=1, max_inflight=2, ready_is_go=ready_is_go)
    sched.prepare(1, PREPARE)
    sched.receive(0, frame(Ready(0), 1), 1.0)
    sched.go(1)
    if not ready_is_go:  # the GO went out; step 2 is prepared and waits for READY
        sched.prepare(2, PREPARE)
    body = dataclasses.replace(result(), ready_next=True)
    done, violation = sched.receive(0, frame(body, 1), 2.0)
    assert isinstance(done, StepDone) and not done.next_ready
    assert isinstance(violation, ProtocolViolation) and violation.step == 2
    assert "saying READY for the next step" in violation.message


def test_after_a_refused_step_the_next_one_is_answered_at_once_not_in_the_running_steps_result() -> None:
    """Step 2 is refused while step 1 runs and aborted; step 3 arrives while step 1 still runs. Its
    READY cannot ride in RESULT 1 (which says READY for step 2 or nothing), so it goes at once."""
    sched, rank = one_rank()
    sched.prepare(1, PREPARE)
    rank.receive(frame(PREPARE, 1))
    sched.receive(0, frame(rank.ready_or_ride(1)[0], 1), 1.0)
    sched.go(1)
    sched.prepare(2, PREPARE)
    rank.receive(frame(PREPARE, 2))
    reject, _ = rank.reject(2, ProtocolError(RejectCode.PAGE_OUT_OF_RANGE, "page 9999"))
    sched.receive(0, frame(reject, 2), 1.5)
    abort, _ = sched.abort(2, "refused")
    rank.receive(frame(abort, 2))
    sched.prepare(3, PREPARE)
    rank.receive(frame(PREPARE, 3))
    ready = rank.ready_or_ride(3)
    assert ready is not None and rank.running == (1, 3)
    assert sched.receive(0, frame(ready[0], 3), 2.0) == [StepReady(3)]
    body, _ = rank.result(1, result())
    assert not body.ready_next
