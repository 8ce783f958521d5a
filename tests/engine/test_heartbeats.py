"""The scheduler's heartbeat fills a silence: a PREPARE, GO or CUT to every rank tells them the
scheduler lives as well, so while steps go out more often than heartbeat_s none is sent."""

from __future__ import annotations

from protocol.frames import Heartbeat, Prepare
from tests.engine.test_ready_in_result import lone_rank_loop
from tp_runtime.step_loop import EngineTimeouts


def test_a_heartbeat_goes_out_only_after_heartbeat_s_without_a_frame() -> None:
    timeouts = EngineTimeouts()
    loop, wire, _ = lone_rank_loop(timeouts)
    loop._plan()
    assert [type(body) for body, _ in wire.sent] == [Prepare]
    sent_at = loop._last_sent
    loop._welcomed_at = sent_at  # the rank was heard from as the step went out
    loop._duties(sent_at + timeouts.heartbeat_s * 0.9)
    assert [type(body) for body, _ in wire.sent] == [Prepare]
    loop._duties(sent_at + timeouts.heartbeat_s)
    assert [type(body) for body, _ in wire.sent] == [Prepare, Heartbeat]


def test_frames_that_keep_going_out_never_put_the_liveness_looks_off() -> None:
    # With nothing in flight the loop looks when a heartbeat may be due; each frame sent puts that
    # off, so the last looks bound it too: a rank's silence and closed connections are still seen.
    timeouts = EngineTimeouts()
    loop, _, _ = lone_rank_loop(timeouts)
    loop._duties_at, loop._last_sent = 100.0, 130.0
    assert loop._next_duty(131.0) == 100.0 + timeouts.heartbeat_s
