"""The scheduler's half of the conversation: every transition, legal and not, as a table."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from protocol.conversation import (
    HandshakeComplete,
    HandshakeRefused,
    Phase,
    ProtocolViolation,
    RankShutdown,
    SchedulerConversation,
    StepDone,
    StepFailed,
    StepReady,
    StepRefused,
)
from protocol.errors import ProtocolError, RejectCode, UsageError
from protocol.frames import Abort, Done, Go, Heartbeat, Prepare, Ready, Reject, Shutdown, Welcome
from tests.protocol.conversation_helpers import PREPARE, V, frame, hello, result, running_scheduler
from tests.protocol.wire_samples import GEOMETRY, RUN_ID

# -- the handshake ------------------------------------------------------------------------------


def handshake(*hellos, world: int = 2, planned=None, supported=(V,)):
    conv = SchedulerConversation(world_size=world, run_id=RUN_ID, planned=planned, supported_versions=supported)
    events = []
    for item in hellos:
        rank, f = item if isinstance(item, tuple) else (item.rank, frame(item))
        events.extend(conv.receive(rank, f, 1.0))
    return conv, events


def test_agreeing_hellos_complete_the_handshake_with_rank_zeros_geometry() -> None:
    conv, events = handshake(hello(1), hello(0))
    (done,) = events
    assert isinstance(done, HandshakeComplete) and done.version == V and done.geometry == GEOMETRY
    assert [h.rank for h in done.hellos] == [0, 1] and conv.phase is Phase.AGREED
    welcome, step = conv.welcome()
    assert welcome == Welcome(V, 1, 2, GEOMETRY) and step == 0 and conv.phase is Phase.RUNNING
    assert conv.last_heard == {0: 1.0, 1: 1.0}


def test_the_highest_version_common_to_every_rank_is_chosen() -> None:
    # The HELLO frames themselves go out at version V, which every side here supports.
    _, events = handshake(hello(0, versions=(V - 1, V, V + 1)), hello(1, versions=(V, V + 1)), supported=(V - 2, V - 1, V))
    assert events[0].version == V
    _, events = handshake(hello(0, versions=(V - 1,)), hello(1, versions=(V,)), supported=(V - 1, V))
    (refused,) = events
    assert isinstance(refused, HandshakeRefused) and refused.code == RejectCode.BAD_VERSION
    assert f"rank 0 on host host-0 [{V - 1}]" in refused.message and f"rank 1 on host host-1 [{V}]" in refused.message


class Planned:
    """What a SchedulerConfig offers the conversation: the geometry fields it plans with."""

    def __init__(self, **changes: int) -> None:
        for name in ("num_kv_pages", "page_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_host_pages"):
            setattr(self, name, changes.get(name, getattr(GEOMETRY, name)))


HANDSHAKE_REFUSALS = [
    ("world size", [hello(0), hello(1, world_size=3)], RejectCode.GEOMETRY_MISMATCH, "rank 1 on host host-1: runs with world size 3"),
    ("layout in the body", [hello(0, layout=2)], RejectCode.BAD_LAYOUT, "rank 0 on host host-0: uses cache layout 2"),
    ("layout in the envelope", [(0, frame(hello(0), layout=2))], RejectCode.BAD_LAYOUT, "layout version 2"),
    ("no common version", [hello(0, versions=(99,))], RejectCode.BAD_VERSION, "speaks protocol versions [99]"),
    ("envelope version", [(0, frame(hello(0), version=99))], RejectCode.BAD_VERSION, "HELLO has protocol version 99"),
    ("run id", [(0, frame(hello(0), run_id="other"))], RejectCode.BAD_RUN_ID, "'other'"),
    ("identity", [(0, frame(hello(1)))], RejectCode.MALFORMED, "its HELLO says rank 1"),
    ("outside the world", [hello(2)], RejectCode.GEOMETRY_MISMATCH, "rank 2 on host host-2: rank 2 is not in this launch's world of 2"),
    (
        "options",
        [hello(0), hello(1, config_fingerprint="other", host="node-b")],
        RejectCode.GEOMETRY_MISMATCH,
        "rank 1 on host node-b was started with other options (fingerprint other) than rank 0 on host host-0",
    ),
    ("weights", [hello(1, model_fingerprint="w2"), hello(0)], RejectCode.GEOMETRY_MISMATCH, "rank 1 on host host-1 loaded other weights"),
    (
        "geometry",
        [hello(0), hello(1, geometry=replace(GEOMETRY, num_kv_heads=4))],
        RejectCode.GEOMETRY_MISMATCH,
        "rank 1 on host host-1 (compared with rank 0) has a different cache geometry: num_kv_heads 4 (expected 2)",
    ),
]


@pytest.mark.parametrize("hellos, code, needle", [c[1:] for c in HANDSHAKE_REFUSALS], ids=[c[0] for c in HANDSHAKE_REFUSALS])
def test_hellos_that_cannot_run_together_are_refused_naming_rank_and_host(hellos, code, needle) -> None:
    conv, events = handshake(*hellos)
    refused = events[-1]
    assert isinstance(refused, HandshakeRefused) and refused.code == code, events
    assert needle in refused.message, refused.message
    assert conv.phase is Phase.REFUSED
    assert conv.receive(1, frame(hello(1)), 2.0) == []  # nothing more is heard: only SHUTDOWN is left
    with pytest.raises(UsageError):
        conv.welcome()
    assert conv.shutdown("refused").body == Shutdown("refused") and conv.phase is Phase.CLOSED


def test_the_scheduler_plan_must_match_every_ranks_cache() -> None:
    _, events = handshake(hello(0), planned=Planned(num_host_pages=0))
    assert isinstance(events[0], HandshakeRefused)
    assert "its cache has num_host_pages 32, the scheduler plans with 0" in events[0].message
    _, events = handshake(hello(0), hello(1), planned=Planned())
    assert isinstance(events[0], HandshakeComplete)


def test_other_frames_during_the_handshake() -> None:
    conv = SchedulerConversation(world_size=2, run_id=RUN_ID)
    assert conv.receive(0, frame(Heartbeat(0)), 1.0) == []
    assert conv.receive(0, frame(hello(0)), 1.0) == []
    (again,) = conv.receive(0, frame(hello(0)), 1.0)
    assert isinstance(again, ProtocolViolation) and again.code == RejectCode.UNEXPECTED_FRAME and "a second time" in again.message
    (early,) = conv.receive(1, frame(Ready(1), 1), 1.0)
    assert isinstance(early, ProtocolViolation) and early.code == RejectCode.UNEXPECTED_FRAME
    (bad,) = conv.receive(1, ProtocolError(RejectCode.MALFORMED, "no msgpack"), 1.0)
    assert isinstance(bad, ProtocolViolation) and bad.step is None and bad.host == "?"
    (bye,) = conv.receive(1, frame(Shutdown("oom")), 1.0)
    assert bye == RankShutdown(1, "?", "oom")
    assert conv.phase is Phase.HANDSHAKE


# -- steps ----------------------------------------------------------------------------------------


def staged(world: int = 2, max_inflight: int = 1) -> SchedulerConversation:
    conv = running_scheduler(world, max_inflight)
    conv.prepare(1, PREPARE)
    return conv


def send(conv: SchedulerConversation, rank: int, body, step: int, **kw):
    return conv.receive(rank, frame(body, step, **kw), 5.0)


def reject(rank: int, code=RejectCode.PAGE_OUT_OF_RANGE, seq_ids=()) -> Reject:
    return Reject(rank, int(code), "no", np.asarray(seq_ids, np.int64))


def test_a_step_all_ranks_ready_then_done() -> None:
    conv = staged()
    assert conv.staged == 1 and conv.unanswered(1) == {0, 1} and conv.next_step == 2
    assert send(conv, 1, Ready(1), 1) == []
    assert send(conv, 0, Ready(0), 1) == [StepReady(1)]
    assert conv.go(1) == (Go(), 1) and conv.staged is None and conv.unfinished(1) == {0, 1}
    assert send(conv, 1, Done(1), 1) == []
    (done,) = send(conv, 0, result(), 1)
    assert isinstance(done, StepDone) and done.step == 1 and done.result.seq_ids.tolist() == [1000]
    assert conv.in_flight == () and conv.last_heard == {0: 5.0, 1: 5.0}


def test_refusals_are_collected_until_every_rank_answered() -> None:
    conv = staged()
    assert send(conv, 0, reject(0, RejectCode.BAD_SAMPLING, [7, 9]), 1) == []
    (refused,) = send(conv, 1, reject(1, RejectCode.BAD_SAMPLING, [9, 11]), 1)
    assert isinstance(refused, StepRefused) and [r.rank for r in refused.rejections] == [0, 1]
    assert refused.seq_ids == (7, 9, 11) and "rank 0 on host host-0 rejected step 1: BAD_SAMPLING: no" in refused.message
    with pytest.raises(UsageError, match="before every rank is READY"):
        conv.go(1)
    assert conv.abort(1, "bad sampling") == (Abort("bad sampling"), 1)
    assert conv.in_flight == () and conv.next_step == 2
    # Late answers to the aborted step are dropped, not reported.
    assert send(conv, 0, Ready(0), 1) == [] and send(conv, 1, reject(1), 1) == []


def test_one_whole_frame_refusal_fails_the_whole_step() -> None:
    conv = staged()
    send(conv, 0, reject(0, RejectCode.BAD_SAMPLING, [7]), 1)
    (refused,) = send(conv, 1, reject(1, RejectCode.PAGE_TABLE_BASE_MISMATCH), 1)
    assert refused.seq_ids == ()


def test_a_reject_after_ready_takes_the_ready_back() -> None:
    conv = staged()
    send(conv, 0, Ready(0), 1)
    assert send(conv, 1, Ready(1), 1) == [StepReady(1)]
    (refused,) = send(conv, 1, reject(1), 1)
    assert isinstance(refused, StepRefused)
    with pytest.raises(UsageError):
        conv.go(1)


def test_a_reject_after_go_fails_the_step() -> None:
    conv = staged()
    send(conv, 0, Ready(0), 1)
    send(conv, 1, Ready(1), 1)
    conv.go(1)
    (failed,) = send(conv, 1, reject(1, RejectCode.INTERNAL), 1)
    assert failed == StepFailed(1, 1, "host-1", RejectCode.INTERNAL, "no")


def go_step_one(conv: SchedulerConversation) -> None:
    for r in conv.ranks:
        send(conv, r, Ready(r), 1)
    conv.go(1)


VIOLATIONS = [
    # (what, setup, rank, body, step, frame keywords, code)
    ("READY twice", None, 0, "ready-twice", 1, {}, RejectCode.UNEXPECTED_FRAME),
    ("READY for a step never prepared", None, 0, Ready(0), 2, {}, RejectCode.UNEXPECTED_FRAME),
    ("READY for a step long done", None, 0, Ready(0), 0, {}, RejectCode.UNEXPECTED_FRAME),
    ("REJECT for a step never prepared", None, 0, reject(0), 5, {}, RejectCode.UNEXPECTED_FRAME),
    ("READY naming another rank", None, 0, Ready(1), 1, {}, RejectCode.MALFORMED),
    ("DONE naming another rank", go_step_one, 1, Done(0), 1, {}, RejectCode.MALFORMED),
    ("another version", None, 0, Ready(0), 1, {"version": V + 1}, RejectCode.BAD_VERSION),
    ("another layout", None, 0, Ready(0), 1, {"layout": 9}, RejectCode.BAD_LAYOUT),
    ("another run", None, 0, Ready(0), 1, {"run_id": "x"}, RejectCode.BAD_RUN_ID),
    ("READY after GO", go_step_one, 0, Ready(0), 1, {}, RejectCode.UNEXPECTED_FRAME),
    ("RESULT before GO", None, 0, result(), 1, {}, RejectCode.UNEXPECTED_FRAME),
    ("DONE from rank 0", go_step_one, 0, Done(0), 1, {}, RejectCode.UNEXPECTED_FRAME),
    ("RESULT from rank 1", go_step_one, 1, result(), 1, {}, RejectCode.UNEXPECTED_FRAME),
    ("RESULT for another step", go_step_one, 0, result(), 2, {}, RejectCode.UNEXPECTED_FRAME),
    ("HELLO again", None, 0, hello(0), 0, {}, RejectCode.UNEXPECTED_FRAME),
    ("PREPARE from a rank", None, 0, PREPARE, 1, {}, RejectCode.UNEXPECTED_FRAME),
    ("GO from a rank", None, 0, Go(), 1, {}, RejectCode.UNEXPECTED_FRAME),
    ("ABORT from a rank", None, 0, Abort("x"), 1, {}, RejectCode.UNEXPECTED_FRAME),
    ("WELCOME from a rank", None, 0, Welcome(V, 1, 2, GEOMETRY), 0, {}, RejectCode.UNEXPECTED_FRAME),
    ("a rank outside the world", None, 5, Ready(5), 1, {}, RejectCode.GEOMETRY_MISMATCH),
]


@pytest.mark.parametrize("setup, rank, body, step, kw, code", [v[1:] for v in VIOLATIONS], ids=[v[0] for v in VIOLATIONS])
def test_frames_that_break_the_conversation_are_violations(setup, rank, body, step, kw, code) -> None:
    conv = staged()
    if setup is not None:
        setup(conv)
    if body == "ready-twice":
        send(conv, 0, Ready(0), 1)
        body = Ready(0)
    before = (conv.in_flight, conv.staged, conv.unanswered(1), conv.unfinished(1))
    (event,) = send(conv, rank, body, step, **kw)
    assert isinstance(event, ProtocolViolation) and event.rank == rank and event.code == code, event
    assert (conv.in_flight, conv.staged, conv.unanswered(1), conv.unfinished(1)) == before


def test_undecodable_frames_heartbeats_and_a_ranks_shutdown() -> None:
    conv = staged()
    (bad,) = conv.receive(1, ProtocolError(RejectCode.LENGTH_MISMATCH, "short part"), 7.0)
    assert bad == ProtocolViolation(1, "host-1", None, RejectCode.LENGTH_MISMATCH, "short part")
    assert send(conv, 0, Heartbeat(0), 0) == []
    assert conv.last_heard == {0: 5.0, 1: 7.0}
    assert send(conv, 0, Shutdown("bye"), 0) == [RankShutdown(0, "host-0", "bye")]


def test_after_shutdown_nothing_is_heard_and_nothing_but_shutdown_is_sent() -> None:
    conv = staged()
    conv.shutdown("over")
    assert send(conv, 0, Ready(0), 1) == []
    for call in (lambda: conv.go(1), lambda: conv.abort(1, "x"), conv.heartbeat, lambda: conv.prepare(2, PREPARE)):
        with pytest.raises(UsageError, match="closed"):
            call()


# -- what the caller may not do -------------------------------------------------------------------


def test_illegal_calls_are_usage_errors() -> None:
    conv = SchedulerConversation(world_size=2, run_id=RUN_ID)
    for call in (conv.welcome, conv.heartbeat, lambda: conv.prepare(1, PREPARE), lambda: conv.go(1)):
        with pytest.raises(UsageError):
            call()
    with pytest.raises(UsageError, match="Frame or a ProtocolError"):
        conv.receive(0, b"parts", 0.0)
    with pytest.raises(UsageError):
        SchedulerConversation(world_size=0, run_id=RUN_ID)
    conv = running_scheduler()
    with pytest.raises(UsageError, match="next step is 1"):
        conv.prepare(2, PREPARE)
    conv.prepare(1, PREPARE)
    with pytest.raises(UsageError, match="waits for GO or ABORT"):
        conv.prepare(2, PREPARE)
    with pytest.raises(UsageError, match="step waiting for GO is 1"):
        conv.go(2)
    go_step_one(conv)
    with pytest.raises(UsageError, match="GOed step cannot be aborted"):
        conv.abort(1, "late")
    with pytest.raises(UsageError, match="max_inflight 1"):
        conv.prepare(2, PREPARE)
    with pytest.raises(UsageError):
        conv.go(1)


# -- pipelining -----------------------------------------------------------------------------------


def test_with_two_in_flight_the_next_prepare_follows_go_and_results_come_in_order() -> None:
    conv = staged(max_inflight=2)
    go_step_one(conv)
    conv.prepare(2, PREPARE)
    with pytest.raises(UsageError, match="waits for GO"):
        conv.prepare(3, PREPARE)
    assert send(conv, 1, Done(1), 1) == []  # rank 1 finished step 1 before anyone answered step 2
    assert send(conv, 0, Ready(0), 2) == [] and send(conv, 1, Ready(1), 2) == [StepReady(2)]
    conv.go(2)
    with pytest.raises(UsageError, match="max_inflight 2"):
        conv.prepare(3, PREPARE)
    (early,) = send(conv, 0, result(), 2)  # rank 0 must finish step 1 first
    assert isinstance(early, ProtocolViolation) and "step 1 is this rank's next to finish" in early.message
    assert send(conv, 1, Done(1), 2) == []
    assert [type(e) for e in send(conv, 0, result(), 1)] == [StepDone]
    conv.prepare(3, PREPARE)
    assert [e.step for e in send(conv, 0, result(), 2)] == [2]
    assert conv.in_flight == (3,)


def test_aborting_the_next_step_keeps_the_running_one() -> None:
    conv = staged(max_inflight=2)
    go_step_one(conv)
    conv.prepare(2, PREPARE)
    send(conv, 0, reject(0), 2)
    (refused,) = send(conv, 1, Ready(1), 2)
    assert isinstance(refused, StepRefused)
    conv.abort(2, refused.message)
    assert conv.in_flight == (1,) and conv.next_step == 3
    send(conv, 1, Done(1), 1)
    assert [e.step for e in send(conv, 0, result(), 1)] == [1]
    conv.prepare(3, PREPARE)


def test_prepare_cannot_skip_a_number_after_an_abort() -> None:
    conv = staged()
    conv.abort(1, "x")
    with pytest.raises(UsageError, match="next step is 2"):
        conv.prepare(1, Prepare.greedy([1], [1], [0], [1], [0]))
    conv.prepare(2, PREPARE)
