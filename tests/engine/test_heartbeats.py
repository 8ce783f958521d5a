"""The scheduler's heartbeat fills a silence: a PREPARE, GO or CUT to every rank tells them the
scheduler lives as well, so while steps go out more often than heartbeat_s none is sent. And the
loop's looks at liveness come when a threshold can first be crossed, not on a clock."""

from __future__ import annotations

import time

import pytest

from protocol.frames import Heartbeat, Prepare
from tests.engine.test_ready_in_result import lone_rank_loop
from tp_runtime.step_loop import EARLY_HEARTBEAT, EngineTimeouts, RankFailure


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


def test_the_loop_looks_when_the_first_threshold_can_be_crossed_and_frames_sent_never_put_it_off() -> None:
    # No clock of looks: the next one is when a heartbeat is due, a rank's silence would pass
    # peer_silence_s, a READY would be late, or the running step would outlive its deadline.
    timeouts = EngineTimeouts(heartbeat_s=1.0, peer_silence_s=3.0, ready_s=10.0, first_step_s=20.0)
    loop, _, rank = lone_rank_loop(timeouts)
    conv = loop.conversation
    conv._last_heard[0] = loop._welcomed_at = 100.0
    loop._last_sent = 130.0  # frames that keep going out put off the heartbeat, never the silence
    assert loop._next_look(131.0) == 103.0
    conv._last_heard[0] = 140.0
    assert loop._next_look(141.0) == 131.0
    loop._welcomed_at = time.monotonic()
    loop.iterate(0)  # step 1 planned: its READY is due ready_s after it went out
    entry = loop._inflight[1]
    loop._last_sent = conv._last_heard[0] = float("inf")  # (no heartbeat due, nobody silent)
    assert loop._next_look(entry.sent_at) == entry.sent_at + timeouts.ready_s
    rank.take_frames()
    loop.iterate(0)  # READY 1: the step runs, and step 2's READY rides on its RESULT (never late)
    assert entry.started_at is not None and conv.staged == 2
    loop._last_sent = conv._last_heard[0] = float("inf")
    # Before any step was measured, a first step's deadline is first_step_s.
    assert loop._next_look(entry.started_at) == entry.started_at + timeouts.first_step_s


def test_a_frame_that_ends_a_silence_is_counted_as_the_longest_silence() -> None:
    loop, _, rank = lone_rank_loop()
    loop.iterate(0)
    loop.conversation._last_heard[0] = loop._welcomed_at = time.monotonic() - 0.7  # last heard 0.7 s ago
    rank.take_frames()  # its READY comes now
    loop.iterate(0)
    assert 0.7 <= loop.counters.longest_silence_s < 0.7 + 30


def test_a_heartbeat_nearly_due_goes_out_with_the_wake_up_a_ranks_frame_brought() -> None:
    # The ranks send a frame at least every 0.5 s: the scheduler's heartbeat rides on the bursts
    # those wake rather than waking the engine thread on its own.
    timeouts = EngineTimeouts(heartbeat_s=20.0, peer_silence_s=60.0)  # wide margins on a loaded machine
    loop, wire, rank = lone_rank_loop(timeouts)
    loop.iterate(0)
    assert [type(body) for body, _ in wire.sent] == [Prepare]
    loop._last_sent = time.monotonic() - (EARLY_HEARTBEAT - 0.25) * timeouts.heartbeat_s
    rank.send(*rank.conv.heartbeat())
    loop.iterate(0)  # a frame, but the heartbeat is not nearly due
    assert [type(body) for body, _ in wire.sent] == [Prepare]
    loop._last_sent = time.monotonic() - EARLY_HEARTBEAT * timeouts.heartbeat_s
    loop.iterate(0)  # no frame from the rank: no heartbeat before it is due
    assert [type(body) for body, _ in wire.sent] == [Prepare]
    rank.send(*rank.conv.heartbeat())
    loop.iterate(0)
    assert [type(body) for body, _ in wire.sent] == [Prepare, Heartbeat]


def test_the_loop_waits_until_its_next_look_and_finds_a_silent_rank_there() -> None:
    timeouts = EngineTimeouts(heartbeat_s=10.0, peer_silence_s=30.0)
    loop, wire, _ = lone_rank_loop(timeouts)
    loop.iterate(60)  # the PREPARE goes out: nothing is due before its heartbeat, 10 s on
    assert 5_000 < wire.waits[-1] <= 10_000  # the 0.2 s clock of looks waited 200 ms
    loop.conversation._last_heard[0] = loop._welcomed_at = time.monotonic() - 31.0
    with pytest.raises(RankFailure, match="stopped answering"):
        loop.iterate(60)
