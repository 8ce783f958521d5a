"""An executor's half of the conversation: every transition, legal and not, as a table."""

from __future__ import annotations

from dataclasses import replace

import pytest

from protocol.conversation import (
    AbortReceived,
    ExecutorConversation,
    GoReceived,
    Ignored,
    Phase,
    PrepareReceived,
    Refused,
    ShutdownReceived,
    Welcomed,
    WelcomeRefused,
)
from protocol.errors import ProtocolError, RejectCode, UsageError
from protocol.frames import Abort, Done, Go, Heartbeat, Hello, Ready, Reject, Shutdown, Welcome
from tests.protocol.conversation_helpers import PREPARE, V, frame, hello, result, welcomed_executor
from tests.protocol.wire_samples import GEOMETRY, RUN_ID, with_arrays


def new_executor(rank: int = 0, world: int = 2) -> ExecutorConversation:
    conv = ExecutorConversation(
        rank=rank, world_size=world, run_id=RUN_ID, geometry=GEOMETRY, model_fingerprint="w", config_fingerprint="o", host="h"
    )
    assert conv.hello() == (Hello(rank, world, (V,), 1, "w", GEOMETRY, "o", "h"), 0)
    return conv


# -- waiting for WELCOME ---------------------------------------------------------------------------


def test_welcome_that_fits_this_rank() -> None:
    conv = new_executor()
    assert conv.receive(frame(Heartbeat(-1))) == []
    assert conv.receive(frame(Welcome(V, 1, 2, GEOMETRY), 4)) == [Welcomed(V)]
    assert conv.phase is Phase.RUNNING and conv.version == V and conv.last_step == 4


WELCOME_REFUSALS = [
    ("geometry", frame(Welcome(V, 1, 2, replace(GEOMETRY, num_kv_pages=10))), "num_kv_pages 10 (expected 512); this rank cannot run it"),
    ("world size", frame(Welcome(V, 1, 3, GEOMETRY)), "WELCOME says world size 3; this rank was started in a world of 2"),
    ("layout", frame(Welcome(V, 2, 2, GEOMETRY)), "WELCOME chose cache layout 2"),
    ("version", frame(Welcome(V + 1, 1, 2, GEOMETRY)), f"WELCOME chose protocol version {V + 1}"),
    ("stamped version", frame(Welcome(V + 1, 1, 2, GEOMETRY), version=V + 1), f"WELCOME has protocol version {V + 1}"),
    ("envelope layout", frame(Welcome(V, 1, 2, GEOMETRY), layout=3), "cache layout version 3"),
]


@pytest.mark.parametrize("welcome, needle", [w[1:] for w in WELCOME_REFUSALS], ids=[w[0] for w in WELCOME_REFUSALS])
def test_a_welcome_this_rank_cannot_run_is_refused(welcome, needle) -> None:
    conv = new_executor()
    (refused,) = conv.receive(welcome)
    assert isinstance(refused, WelcomeRefused) and needle in refused.message, refused
    assert conv.phase is Phase.CLOSED


@pytest.mark.parametrize(
    "got",
    [
        frame(Welcome(V, 1, 2, GEOMETRY), run_id="other-run"),
        frame(PREPARE, 1),
        frame(Go(), 1),
        ProtocolError(RejectCode.BAD_MAC, "forged"),
    ],
    ids=["other run", "PREPARE", "GO", "bad frame"],
)
def test_before_welcome_other_frames_are_dropped_unanswered(got) -> None:
    conv = new_executor()
    (ignored,) = conv.receive(got)
    assert isinstance(ignored, Ignored) and conv.phase is Phase.HANDSHAKE


def test_shutdown_before_welcome_ends_the_conversation() -> None:
    conv = new_executor()
    assert conv.receive(frame(Shutdown("rank 1 disagrees"))) == [ShutdownReceived("rank 1 disagrees")]
    assert isinstance(conv.receive(frame(Welcome(V, 1, 2, GEOMETRY)))[0], Ignored)


# -- steps ----------------------------------------------------------------------------------------


def staged(rank: int = 0) -> ExecutorConversation:
    conv = welcomed_executor(rank)
    (event,) = conv.receive(frame(PREPARE, 1))
    assert isinstance(event, PrepareReceived) and event.step == 1 and event.prepare is PREPARE
    assert conv.ready(1) == (Ready(rank), 1)
    return conv


def test_prepare_ready_go_result() -> None:
    conv = staged()
    assert conv.staged == 1
    assert conv.receive(frame(Go(), 1)) == [GoReceived(1)]
    assert conv.running == (1,) and conv.staged is None
    r = result()
    assert conv.result(1, r) == (r, 1) and conv.running == ()
    assert conv.heartbeat() == (Heartbeat(0), 1)


def test_other_ranks_answer_done() -> None:
    conv = staged(rank=1)
    conv.receive(frame(Go(), 1))
    assert conv.done(1) == (Done(1), 1)


def test_an_invalid_prepare_is_refused_with_its_sequences_and_uses_its_step_up() -> None:
    conv = welcomed_executor()
    bad = with_arrays(PREPARE, top_p=[1, 0, 1, 1])
    (refused,) = conv.receive(frame(bad, 1))
    assert isinstance(refused, Refused) and refused.step == 1 and refused.error.code == RejectCode.BAD_SAMPLING
    assert refused.error.seq_ids == (int(PREPARE.seq_ids[1]),)
    body, step = conv.reject(refused.step, refused.error)
    assert step == 1 and isinstance(body, Reject) and body.seq_ids.tolist() == [int(PREPARE.seq_ids[1])]
    assert conv.receive(frame(Abort("rank 0 refused"), 1)) == [AbortReceived(1, "rank 0 refused", dropped=False)]
    assert isinstance(conv.receive(frame(PREPARE, 2))[0], PrepareReceived)


def test_a_prepare_the_caller_cannot_stage_is_rejected_and_its_abort_acknowledged() -> None:
    conv = welcomed_executor()
    conv.receive(frame(PREPARE, 1))
    error = ProtocolError(RejectCode.PAGE_TABLE_BASE_MISMATCH, "diverged")
    assert conv.reject(1, error).body.code == RejectCode.PAGE_TABLE_BASE_MISMATCH
    assert conv.staged is None
    with pytest.raises(UsageError):
        conv.ready(1)
    assert conv.receive(frame(Abort("x"), 1)) == [AbortReceived(1, "x", dropped=False)]


def test_abort_of_the_staged_step_drops_it() -> None:
    conv = staged()
    assert conv.receive(frame(Abort("rank 1 refused"), 1)) == [AbortReceived(1, "rank 1 refused", dropped=True)]
    assert conv.staged is None
    (go,) = conv.receive(frame(Go(), 1))
    assert isinstance(go, Refused) and go.error.code == RejectCode.UNEXPECTED_FRAME


def test_an_abort_far_ahead_uses_every_step_up_to_it() -> None:
    conv = welcomed_executor()
    (refused,) = conv.receive(frame(PREPARE, 3))  # out of sequence: refused, no number used
    assert isinstance(refused, Refused) and refused.error.code == RejectCode.BAD_STEP
    assert conv.receive(frame(Abort("out of sequence"), 3)) == [AbortReceived(3, "out of sequence", dropped=False)]
    assert conv.last_step == 3 and isinstance(conv.receive(frame(PREPARE, 4))[0], PrepareReceived)


def test_abort_of_a_step_whose_prepare_never_arrived_uses_it_up() -> None:
    conv = welcomed_executor()
    (refused,) = conv.receive(ProtocolError(RejectCode.BAD_MAC, "damaged"))  # it was PREPARE 1
    assert refused.step == 1
    assert conv.receive(frame(Abort("rank 0 could not read it"), 1)) == [AbortReceived(1, "rank 0 could not read it", dropped=False)]
    assert conv.last_step == 1 and isinstance(conv.receive(frame(PREPARE, 2))[0], PrepareReceived)


REFUSALS = [
    # (what, setup: "welcomed" | "pending" | "staged" | "running", frame, code)
    ("PREPARE skipping a step", "welcomed", frame(PREPARE, 2), RejectCode.BAD_STEP),
    ("PREPARE repeating a step", "running", frame(PREPARE, 1), RejectCode.BAD_STEP),
    ("PREPARE while one is staged", "staged", frame(PREPARE, 2), RejectCode.UNEXPECTED_FRAME),
    ("PREPARE before the last is answered", "pending", frame(PREPARE, 2), RejectCode.UNEXPECTED_FRAME),
    ("GO with nothing staged", "welcomed", frame(Go(), 1), RejectCode.UNEXPECTED_FRAME),
    ("GO before READY", "pending", frame(Go(), 1), RejectCode.UNEXPECTED_FRAME),
    ("GO for another step", "staged", frame(Go(), 2), RejectCode.UNEXPECTED_FRAME),
    ("GO twice", "running", frame(Go(), 1), RejectCode.UNEXPECTED_FRAME),
    ("ABORT of a running step", "running", frame(Abort("x"), 1), RejectCode.UNEXPECTED_FRAME),
    ("another version", "staged", frame(Go(), 1, version=V + 1), RejectCode.BAD_VERSION),
    ("another layout", "staged", frame(Go(), 1, layout=4), RejectCode.BAD_LAYOUT),
    ("another run", "staged", frame(Go(), 1, run_id="x"), RejectCode.BAD_RUN_ID),
    ("HELLO", "welcomed", frame(hello(1)), RejectCode.UNEXPECTED_FRAME),
    ("WELCOME again", "welcomed", frame(Welcome(V, 1, 2, GEOMETRY)), RejectCode.UNEXPECTED_FRAME),
    ("READY", "welcomed", frame(Ready(1), 1), RejectCode.UNEXPECTED_FRAME),
    ("RESULT", "running", frame(result(), 1), RejectCode.UNEXPECTED_FRAME),
    ("DONE", "running", frame(Done(1), 1), RejectCode.UNEXPECTED_FRAME),
    ("REJECT", "welcomed", frame(Reject(1, 5, "x"), 1), RejectCode.UNEXPECTED_FRAME),
]


def in_state(state: str) -> ExecutorConversation:
    conv = welcomed_executor()
    if state == "welcomed":
        return conv
    conv.receive(frame(PREPARE, 1))
    if state == "pending":
        return conv
    conv.ready(1)
    if state == "staged":
        return conv
    conv.receive(frame(Go(), 1))
    return conv


@pytest.mark.parametrize("state, got, code", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_frames_that_break_the_conversation_are_refused_and_change_nothing(state, got, code) -> None:
    conv = in_state(state)
    before = (conv.last_step, conv.staged, conv.running)
    (refused,) = conv.receive(got)
    assert isinstance(refused, Refused) and refused.error.code == code and refused.step == got.step, refused
    assert (conv.last_step, conv.staged, conv.running) == before


def test_an_undecodable_frame_is_refused_for_the_step_it_most_likely_was() -> None:
    conv = in_state("staged")
    (refused,) = conv.receive(ProtocolError(RejectCode.BAD_MAC, "damaged"))
    assert refused.step == 1  # the GO for the staged step
    conv = in_state("running")
    assert conv.receive(ProtocolError(RejectCode.MALFORMED, "x"))[0].step == 2  # the next PREPARE


def test_pipelined_the_next_prepare_arrives_while_a_step_runs() -> None:
    conv = in_state("running")
    assert isinstance(conv.receive(frame(PREPARE, 2))[0], PrepareReceived)
    conv.ready(2)
    assert conv.receive(frame(Go(), 2)) == [GoReceived(2)]
    assert conv.running == (1, 2)
    with pytest.raises(UsageError, match="oldest running step is 1"):
        conv.result(2, result())
    conv.result(1, result())
    conv.result(2, result())
    # An ABORT of the next step leaves the running one alone.
    assert isinstance(conv.receive(frame(PREPARE, 3))[0], PrepareReceived)
    conv.ready(3)
    assert conv.receive(frame(Abort("rank 1 refused"), 3)) == [AbortReceived(3, "rank 1 refused", dropped=True)]


def test_a_running_step_whose_forward_failed_is_rejected() -> None:
    conv = in_state("running")
    body, step = conv.reject(1, ProtocolError(RejectCode.INTERNAL, "forward failed"))
    assert step == 1 and body.code == RejectCode.INTERNAL and conv.running == ()


def test_shutdown_ends_it() -> None:
    conv = in_state("staged")
    assert conv.receive(frame(Shutdown("over"))) == [ShutdownReceived("over")]
    assert isinstance(conv.receive(frame(Go(), 1))[0], Ignored)
    with pytest.raises(UsageError):
        conv.heartbeat()


def test_illegal_calls_are_usage_errors() -> None:
    conv = ExecutorConversation(rank=1, world_size=2, run_id=RUN_ID, geometry=GEOMETRY, model_fingerprint="w")
    with pytest.raises(UsageError, match="before HELLO"):
        conv.heartbeat()
    conv.hello()
    with pytest.raises(UsageError, match="once"):
        conv.hello()
    with pytest.raises(UsageError, match="Frame or a ProtocolError"):
        conv.receive(None)
    with pytest.raises(UsageError, match="outside a world"):
        ExecutorConversation(rank=2, world_size=2, run_id=RUN_ID, geometry=GEOMETRY, model_fingerprint="w")
    conv = in_state("running")
    with pytest.raises(UsageError, match="rank 0 sends RESULT"):
        conv.done(1)
    with pytest.raises(UsageError, match="READY for step 1"):
        conv.ready(1)
    with pytest.raises(UsageError, match="takes a ProtocolError"):
        conv.reject(1, "a string")
    other = staged(rank=1)
    other.receive(frame(Go(), 1))
    with pytest.raises(UsageError, match="rank 1 sends DONE"):
        other.result(1, result())
