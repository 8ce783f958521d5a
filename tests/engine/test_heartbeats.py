"""The scheduler's heartbeat fills a silence: a PREPARE, GO or CUT to every rank tells them the
scheduler lives as well, so while steps go out more often than heartbeat_s none is sent."""

from __future__ import annotations

from protocol.frames import Heartbeat, Prepare
from scheduler.request import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.engine.test_ready_in_result import Wire
from tests.protocol.conversation_helpers import running_scheduler
from tests.protocol.wire_samples import GEOMETRY
from tp_runtime.step_loop import EngineTimeouts, StepLoop


def test_a_heartbeat_goes_out_only_after_heartbeat_s_without_a_frame() -> None:
    config = SchedulerConfig(
        num_kv_pages=GEOMETRY.num_kv_pages, page_size=GEOMETRY.page_size, max_num_seqs=4,
        max_num_batched_tokens=64, max_model_len=256, max_inflight_steps=2,
    )  # fmt: skip
    wire = Wire()
    timeouts = EngineTimeouts()
    loop = StepLoop(
        scheduler=Scheduler(config), endpoint=wire, world_size=1, timeouts=timeouts,  # type: ignore[arg-type]
        deliver=lambda outputs: None, on_scheduled=lambda plan: None,
    )  # fmt: skip
    loop.conversation = running_scheduler(world=1, max_inflight=2, ready_is_go=True)
    loop.scheduler.add_request(1, [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
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
    config = SchedulerConfig(
        num_kv_pages=GEOMETRY.num_kv_pages, page_size=GEOMETRY.page_size, max_num_seqs=4,
        max_num_batched_tokens=64, max_model_len=256, max_inflight_steps=2,
    )  # fmt: skip
    timeouts = EngineTimeouts()
    loop = StepLoop(
        scheduler=Scheduler(config), endpoint=Wire(), world_size=1, timeouts=timeouts,  # type: ignore[arg-type]
        deliver=lambda outputs: None, on_scheduled=lambda plan: None,
    )  # fmt: skip
    loop._duties_at, loop._last_sent = 100.0, 130.0
    assert loop._next_duty(131.0) == 100.0 + timeouts.heartbeat_s
