"""News from other threads (submits, cancels) wakes the engine's loop only when it could change what
is planned before a rank's next frame wakes the loop anyway; the plan that frame brings takes it
first, so no request waits a step longer than when every submit woke the loop."""

from __future__ import annotations

from protocol.frames import Prepare
from scheduler.request import SamplingParams
from tests.engine.test_ready_in_result import lone_rank_loop
from tests.server.fake_rank import running_engine
from tp_runtime.step_loop import StepLoop


def _with_inbox(loop: StepLoop) -> list[int]:
    """A list of request ids that stands for the engine's inbox: each is submitted as it is taken."""
    inbox: list[int] = []

    def take_news() -> bool:
        taken = bool(inbox)
        while inbox:
            loop.scheduler.add_request(inbox.pop(0), [8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
        return taken

    loop._take_news = take_news
    return inbox


def _prepared(wire, step: int) -> Prepare:
    return next(body for body, sent in wire.sent if sent == step and isinstance(body, Prepare))


def test_a_submit_while_both_seats_are_taken_waits_for_the_result_whose_plan_takes_it() -> None:
    loop, wire, rank = lone_rank_loop()
    inbox = _with_inbox(loop)
    loop.iterate(0)
    rank.take_frames()
    loop.iterate(0)  # READY 1: step 1 runs, step 2 is planned and its READY will ride on RESULT 1
    rank.take_frames()
    assert not loop.news_wanted  # nothing a submit brings can be planned before RESULT 1
    inbox.append(2)  # posted without a wake-up
    rank.result(1)
    loop.iterate(0)  # RESULT 1: step 3 planned at once, with the request that came meanwhile
    assert 2 in _prepared(wire, 3).seq_ids.tolist()
    assert not inbox


def test_news_posted_as_the_loop_goes_to_wait_is_taken_by_the_loop_instead_of_waiting() -> None:
    loop, wire, _ = lone_rank_loop()
    loop.scheduler.cancel(1)
    loop.iterate(0)
    assert not loop._inflight and loop.news_wanted  # idle: a submit must wake it
    inbox = _with_inbox(loop)
    take = loop._take_news
    posted = []

    def post_after_the_plan_took_nothing() -> bool:
        # A poster that read news_wanted False an instant before the loop set it: no wake-up.
        if not posted:
            posted.append(inbox.append(2))
            return False
        return take()

    loop.news_wanted = False
    loop._take_news = post_after_the_plan_took_nothing
    loop.iterate(60)
    assert 2 in _prepared(wire, 1).seq_ids.tolist()
    assert wire.waits[-1] == 0  # not the minute, nor the next look


def test_a_submit_while_a_frame_of_several_forwards_runs_wakes_the_loop_to_cut_it() -> None:
    # Nothing is planned after a frame of several forwards before its RESULT: a seat is free, so a
    # request that comes while the frame runs wakes the loop, which CUTs the frame short.
    with running_engine(step_delay_s=0.05, max_inflight_steps=2, num_scheduler_steps=16) as engine:
        stream = engine.submit([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        events = iter(stream)
        while len(next(events).token_ids) < 2:  # the prefill's token, then a frame's
            pass
        late = engine.submit([8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
        assert [e.finished for e in late][-1]
        assert engine._loop.counters.cuts >= 1
        engine.cancel(stream.request_id)
