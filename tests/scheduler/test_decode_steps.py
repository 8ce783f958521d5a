"""Several forwards on one frame (SchedulerConfig.num_scheduler_steps): when the scheduler asks for
them, and that they change nothing a request sees. The shadow executors (sched_sim.py) run each
forward, check every slot it reads and writes, and sample as a seeded model would: a token is a
function of the request's seed and context, so the same workload must stream the same tokens
whether its steps run one forward per frame or several."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.frames import Result
from scheduler import SamplingParams, Scheduler, SchedulerConfig, SchedulerConfigError
from tests.scheduler.sched_sim import Driver

STOP = 5


def config(steps: int, inflight: int = 2, **changes: object) -> SchedulerConfig:
    base = dict(
        num_kv_pages=48, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=40,
        max_inflight_steps=inflight, num_scheduler_steps=steps,
    )
    return SchedulerConfig(**{**base, **changes})


class CuttingDriver(Driver):
    """Cuts every step of several forwards after a random one of them, as a CUT would."""

    def __init__(self, *args, seed: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cuts = np.random.default_rng(seed)

    def plan(self):
        plan = super().plan()
        if plan is not None and plan.prepare.decode_steps > 1:
            self.cut(int(self.cuts.integers(1, plan.prepare.decode_steps + 1)))
        return plan


def workload(steps: int, inflight: int, cut_seed: int | None = None) -> Driver:
    """Requests that arrive while others decode, stop on a token mid-frame or end by length, one
    with a penalty and min_tokens, and n = 2 samples of one prompt."""
    cfg = config(steps, inflight)
    d = Driver(Scheduler(cfg), vocab=30, seeded_model=True) if cut_seed is None else CuttingDriver(
        Scheduler(cfg), vocab=30, seeded_model=True, seed=cut_seed
    )
    d.add(0, [7, 8, 9, 10, 11], SamplingParams(max_tokens=17, temperature=0.8, seed=1, stop_token_ids=(STOP,)))
    d.add(1, [7, 8, 12], SamplingParams(max_tokens=9, seed=2))
    for _ in range(10):
        if d.can_plan and d.plan() is not None and d.can_plan:
            continue
        if d.inflight:
            d.complete()
    d.add(2, [13, 14, 15], SamplingParams(max_tokens=23, seed=3, stop_token_ids=(STOP, 6)))
    d.add(3, [20, 21], SamplingParams(max_tokens=12, seed=4, presence_penalty=0.5, min_tokens=5, stop_token_ids=(STOP,)))
    d.add(4, [9, 9, 9], SamplingParams(max_tokens=14, seed=5), prompt_leader=None)
    d.add(5, [9, 9, 9], SamplingParams(max_tokens=14, seed=6), prompt_leader=4)
    d.run_to_end()
    d.check_outputs()
    return d


@pytest.mark.parametrize("inflight", [1, 2])
@pytest.mark.parametrize("steps", [2, 3, 4])
def test_several_forwards_stream_what_one_forward_per_frame_streams(steps: int, inflight: int) -> None:
    one, several = workload(1, inflight), workload(steps, inflight)
    assert several.emitted == one.emitted
    assert several.finished == one.finished
    forwards = [p.prepare.decode_steps for p in several.plans]
    assert max(forwards) == steps
    assert len(several.plans) < len(one.plans)
    assert all(p.prepare.decode_steps == 1 for p in one.plans)
    if inflight == 2:  # planned while the frame before runs, as a CONTINUE the Driver expands and checks
        assert any(p.brief is not None and p.prepare.decode_steps > 1 for p in several.plans)


@pytest.mark.parametrize("seed", range(4))
def test_steps_cut_after_any_forward_stream_the_same_tokens(seed: int) -> None:
    """A CUT ends a step after any of its forwards: the rows step back to the last that ran, the
    page its later forwards opened stays in the table (zeroed; the shadow checks every slot), and
    the next step goes whole from there."""
    one, cut = workload(1, 2), workload(4, 2, cut_seed=seed)
    assert cut.emitted == one.emitted
    assert cut.finished == one.finished
    assert any(f < p.prepare.decode_steps for p, f in cut.ran_forwards)


def test_nothing_is_planned_after_a_step_of_several_forwards_in_flight() -> None:
    d = Driver(Scheduler(config(4)), vocab=30, seeded_model=True)
    d.add(0, [7, 8, 9], SamplingParams(max_tokens=20, seed=1))
    d.plan()  # the prompt
    assert d.plan().prepare.decode_steps == 4  # planned while the prompt runs
    assert d.s.plan_step() is None  # it may be cut: where its rows stand is known from its RESULT
    d.complete()
    assert d.s.plan_step() is None
    d.complete()
    assert d.plan() is not None


def test_a_request_that_can_be_admitted_gets_one_forward_per_frame() -> None:
    """An arrival with a seat free would wait for the whole frame: while one can be admitted,
    frames are one forward, and a frame in flight is cut."""
    d = Driver(Scheduler(config(4, max_num_seqs=2, max_num_batched_tokens=8)), vocab=30, seeded_model=True)
    d.add(0, [7, 8, 9], SamplingParams(max_tokens=10, seed=1))
    d.plan()  # the prompt
    frame = d.plan()
    assert frame.prepare.decode_steps == 4
    assert not d.s.should_cut(frame)
    d.add(1, [7, 8, 10], SamplingParams(max_tokens=10, seed=2))
    assert d.s.should_cut(frame)
    d.run_to_end()
    d.check_outputs()


def test_a_request_without_a_seat_waits_for_the_shortest_row_not_for_one_forward_frames() -> None:
    """With every seat taken the waiting request cannot be admitted before a row ends: frames keep
    their forwards (and are not cut), but none runs past the shortest row's last token, so that
    the request is admitted by the step right after the frame in which that row ended."""
    d = Driver(Scheduler(config(4, max_num_seqs=2, max_num_batched_tokens=8)), vocab=30, seeded_model=True)
    d.add(0, [7, 8, 9], SamplingParams(max_tokens=7, seed=1))
    d.add(1, [7, 8, 11], SamplingParams(max_tokens=13, seed=3))
    d.plan()  # both prompts
    frame = d.plan()
    assert frame.prepare.decode_steps == 4
    d.add(2, [7, 8, 10], SamplingParams(max_tokens=10, seed=2))
    assert not d.s.should_cut(frame)
    d.run_to_end()
    d.check_outputs()
    assert len(d.emitted[0]) == 7 and d.finished[0] == "length"
    last_of_first = max(p.step for p in d.plans if 0 in p.prepare.seq_ids.tolist())
    first_of_third = min(p.step for p in d.plans if 2 in p.prepare.seq_ids.tolist())
    # Request 0: token 1 from the prompt, 4 on the frame, then only the 2 it has left.
    assert [p.prepare.decode_steps for p in d.plans if p.step <= last_of_first] == [1, 4, 2]
    assert first_of_third == last_of_first + 1


def test_a_request_without_a_seat_cuts_a_frame_planned_past_a_row_that_ends_inside_it() -> None:
    """A frame planned before the request came runs up to its longest row: a row that ends inside
    it frees a seat before its last forward, so the frame is cut for the request; one planned
    while it waited is not."""
    d = Driver(Scheduler(config(4, max_num_seqs=2, max_num_batched_tokens=8)), vocab=30, seeded_model=True)
    d.add(0, [7, 8, 9], SamplingParams(max_tokens=3, seed=1))
    d.add(1, [7, 8, 11], SamplingParams(max_tokens=13, seed=3))
    d.plan()  # both prompts
    frame = d.plan()
    assert frame.prepare.decode_steps == 4 and frame.first_row_end == 2  # request 0 ends at its 2nd forward
    assert not d.s.should_cut(frame)
    d.add(2, [7, 8, 10], SamplingParams(max_tokens=10, seed=2))
    assert not d.s._admitter.admissible()  # no seat
    assert d.s.should_cut(frame)
    d.run_to_end()
    d.check_outputs()
    assert d.finished == {0: "length", 1: "length", 2: "length"}


def test_a_request_waiting_for_its_prompt_leader_cannot_be_admitted() -> None:
    d = Driver(Scheduler(config(4, max_num_seqs=4, max_num_batched_tokens=4)), vocab=30, seeded_model=True)
    d.add(0, list(range(7, 19)), SamplingParams(max_tokens=10, seed=1))
    d.add(1, list(range(7, 19)), SamplingParams(max_tokens=10, seed=2), prompt_leader=0)
    d.plan()  # the leader's first chunk: the follower waits for its prompt's pages
    assert d.s.waiting_requests() == (1,)
    assert not d.s._admitter.admissible()
    d.run_to_end()
    d.check_outputs()
    assert d.finished == {0: "length", 1: "length"}


def test_no_forward_past_the_longest_request_nor_before_min_tokens() -> None:
    d = Driver(Scheduler(config(4, inflight=1)), vocab=30, seeded_model=True)
    d.add(0, [7, 8, 9], SamplingParams(max_tokens=6, seed=1, min_tokens=3))
    d.run_to_end()
    d.check_outputs()
    # Prefill samples token 1; tokens 2 and 3 come one per frame (stop tokens are banned until 3
    # are out); then the three left, on one frame.
    assert [p.prepare.decode_steps for p in d.plans] == [1, 1, 1, 3]
    assert len(d.emitted[0]) == 6 and d.finished[0] == "length"


def test_a_non_finite_forward_fails_its_request_after_the_tokens_before_it() -> None:
    d = Driver(Scheduler(config(4, inflight=1)), vocab=30, seeded_model=True)
    d.add(0, [7, 8, 9], SamplingParams(max_tokens=20, seed=1))
    d.step()
    assert d.plan().prepare.decode_steps == 4
    outs = d.complete(frozenset({1}))  # the second forward's row 0
    assert [o.token_ids for o in outs] == [(d.shadow.tokens[0][4],), ()]
    assert outs[-1].finish_reason == "error" and "not finite" in outs[-1].error
    d.run_to_end()
    assert d.s.stats().running == 0


@pytest.mark.parametrize("steps", [0, 5, 33])
def test_the_count_is_one_to_the_page_size(steps: int) -> None:
    with pytest.raises(SchedulerConfigError, match="num_scheduler_steps"):
        config(steps)


def test_a_frames_full_pages_are_offered_to_the_prefix_cache_as_one_forward_per_step_offers_them() -> None:
    """The pages a frame's later forwards fill are keyed once its tokens are taken (they were not:
    the request's known tokens were read before them)."""
    cached = []
    for steps in (1, 4):
        d = Driver(Scheduler(config(steps, inflight=1)), vocab=30, seeded_model=True)
        d.add(0, [7, 8, 9, 10, 11], SamplingParams(max_tokens=30, seed=1, ignore_eos=True))
        d.run_to_end()
        d.check_outputs()
        cached.append(d.s.cache.cached_count)
    assert cached[1] == cached[0] == (5 + 30 - 1) // 4


def test_a_step_aborted_after_a_cut_gives_its_reservation_back_marked() -> None:
    """The page a cut step committed past its context goes back into the reservation when the step
    after it is aborted: marked, as every reserved page is (the shadow's pool check)."""
    d = Driver(Scheduler(config(4, inflight=1, num_kv_pages=16)), vocab=30, seeded_model=True)
    d.add(0, [7, 8], SamplingParams(max_tokens=20, seed=1))
    d.step()  # the prompt
    assert d.plan().prepare.decode_steps == 4  # its last forward opens page 1
    d.cut(1)
    d.complete()
    d.plan()
    d.abort(failed=())  # Driver.check raises if a reserved page is unmarked
    reserved = list(d.s.request_state(0).reserved_pages)
    assert reserved and d.s.pool.marked[reserved].all()
    d.run_to_end()
    d.check_outputs()


def test_a_result_with_more_forwards_than_its_step_asked_for_fails_the_step_with_a_clear_error() -> None:
    d = Driver(Scheduler(config(4, inflight=1)), vocab=30, seeded_model=True)
    d.add(0, [7, 8, 9], SamplingParams(max_tokens=20, seed=1))
    plan = d.s.plan_step()  # the prompt: one forward
    assert plan.prepare.decode_steps == 1
    two = Result(plan.prepare.seq_ids, np.array([5, 6], dtype=np.int32), np.zeros(2, np.float32), np.ones(2, np.uint8))
    assert two.forwards == 2
    outs = d.s.on_result(plan, two)
    assert [(o.finish_reason, o.error) for o in outs] == [
        ("error", f"step {plan.step} was aborted: its RESULT rows do not match the sequences it sampled")
    ]
