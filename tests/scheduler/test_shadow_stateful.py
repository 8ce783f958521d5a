"""Random operation sequences against the shadow model of every KV slot (hypothesis, stateful),
serial and with two steps in flight: stops, cancels and non-finite rows with the next step already
planned, REJECTs of the newest step with and without the sequences that failed, preemption by
recompute and by offload and prefix hits planned while a step runs."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler import AdmissionError, SamplingParams, Scheduler, SchedulerConfig
from tests.scheduler.sched_sim import Driver, ShadowViolation

# Prompts start with one of a few shared prefixes so that snapshots get reused and evicted.
PREFIXES = [[], [7, 8, 9, 10, 11], [7, 8, 9, 10, 11, 12, 13, 14], [3] * 12]
VOCAB = 40
EOS = 2  # sampled now and then: stop by eos


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([2, 4]),
        num_kv_pages=st.integers(8, 16),
        max_num_seqs=st.integers(1, 4),
        extra_budget=st.integers(0, 12),
        num_host_pages=st.sampled_from([0, 8, 16, 32]),
        lookahead=st.integers(0, 2),
        poison=st.booleans(),
        prefix=st.booleans() | st.just(True),
        inflight=st.sampled_from([1, 2, 2]),
        seed=st.integers(0, 2**16),
    )
    def setup(
        self, page_size, num_kv_pages, max_num_seqs, extra_budget, num_host_pages, lookahead, poison, prefix, inflight, seed
    ):
        self.cfg = SchedulerConfig(
            num_kv_pages=num_kv_pages,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_seqs + extra_budget,
            max_model_len=32,
            eos_token_ids=(EOS,),
            num_host_pages=num_host_pages,
            enable_prefix_cache=prefix,
            poison_freed_pages=poison,
            decode_lookahead=lookahead,
            max_inflight_steps=inflight,
        )
        self.d = Driver(Scheduler(self.cfg), vocab=VOCAB, seed=seed)
        self.next_id = 0

    @rule(
        count=st.integers(1, 3),
        prefix=st.sampled_from(range(len(PREFIXES))),
        tail=st.lists(st.integers(3, VOCAB - 1), min_size=0, max_size=10),
        max_tokens=st.integers(1, 12),
        ignore_eos=st.booleans(),
        stop=st.sampled_from([(), (5,)]),
        samples=st.booleans(),
    )
    def admit(self, count, prefix, tail, max_tokens, ignore_eos, stop, samples):
        """count requests, or (samples) count samples of one prompt: the others follow the first."""
        first = self.next_id
        for k in range(count):
            leader = first if samples and k else None
            self._admit_one(PREFIXES[prefix] + tail[0 if samples else k :], max_tokens, ignore_eos, stop, leader)

    def _admit_one(self, prompt, max_tokens, ignore_eos, stop, leader=None):
        if not prompt:
            prompt = [4]
        rid = self.next_id
        self.next_id += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop)
        pages = -(-(len(prompt) + max_tokens - 1) // self.cfg.page_size)
        fits = len(prompt) + max_tokens <= self.cfg.max_model_len and pages <= self.cfg.num_kv_pages
        try:
            self.d.add(rid, prompt, params, prompt_leader=leader)
        except AdmissionError:
            assert not fits
            return
        assert fits

    @precondition(lambda self: self.d.can_plan)
    @rule()
    def plan(self):
        ahead = bool(self.d.inflight)
        before = self.d.s.stats()
        plan = self.d.plan()
        if ahead and plan is not None:
            after = self.d.s.stats()
            event("planned ahead")
            if plan.prepare.feedback.any():
                event("planned ahead: feedback rows")
            if after.preemptions_total > before.preemptions_total:
                event(f"planned ahead: preempted ({'offload' if plan.offloaded else 'recompute'})")
            if after.prefix_hit_pages_total > before.prefix_hit_pages_total:
                event("planned ahead: prefix hit")

    @precondition(lambda self: any(not f.ran for f in self.d.inflight) and len(self.d.inflight) > 1)
    @rule()
    def run_oldest(self):
        """The step GO'd first runs while the next one waits (its RESULT is not back yet)."""
        self.d.run_next()

    @precondition(lambda self: self.d.inflight)
    @rule(outcome=st.integers(0, 9))
    def finish_step(self, outcome):
        """Mostly a RESULT; sometimes a non-finite row."""
        self.d.complete(frozenset({0}) if outcome == 1 else frozenset())

    @precondition(lambda self: self.d.inflight and not self.d.inflight[-1].ran)
    @rule(data=st.data(), how=st.integers(0, 2))
    def abort_newest(self, data, how):
        """The newest step is rejected before it runs: all its requests fail, some, or none."""
        plan = self.d.inflight[-1].plan
        ids = plan.prepare.seq_ids.tolist()
        failed = None if how == 0 else data.draw(st.lists(st.sampled_from(ids), unique=True)) if how == 1 else []
        outs = self.d.abort(failed=failed)
        errors = {o.request_id for o in outs if o.finish_reason == "error"}
        assert errors <= set(ids)
        if failed is None:
            assert set(ids) - errors <= set(self.d.finished)
        else:
            assert errors <= set(failed)
            survivors = set(ids) - set(failed) - set(self.d.finished)
            assert survivors <= set(self.d.s.request_ids())
        event(f"abort: {['all', 'some', 'none'][how]}")

    @precondition(lambda self: self.next_id > 0)
    @rule(data=st.data(), how=st.integers(0, 5))
    def client_ends(self, data, how):
        """A client goes away (cancel) or sees a stop string (finish), at any time."""
        rid = data.draw(st.integers(0, self.next_id - 1))
        if how == 0:
            self.d.s.cancel(rid)
        elif how == 1:
            self.d.s.finish(rid)
        self.d.take(self.d.s.drain_outputs())

    @invariant()
    def pool_consistent(self):
        if hasattr(self, "d"):
            self.d.check()

    def teardown(self):
        if not hasattr(self, "d"):
            return
        d = self.d
        while d.inflight:
            d.complete()
        d.run_to_end()
        assert set(d.finished) == set(d.emitted), "a request was dropped"
        d.check_outputs()
        s = d.s
        st_ = s.stats()
        for name in ("preemptions_total", "offloads_total", "restores_total", "evictions_total", "aborted_steps_total"):
            event(f"{name} > 0: {getattr(st_, name) > 0} (max_inflight_steps {self.cfg.max_inflight_steps})")
        assert st_.running == st_.waiting == st_.preempted == 0
        s.cache.evict(s.cache.evictable_count)
        if s.pool.free_count != self.cfg.num_kv_pages:
            raise ShadowViolation(f"{self.cfg.num_kv_pages - s.pool.free_count} pages never came back")
        assert s.stats().host_pages_free == self.cfg.num_host_pages


SLOW = os.environ.get("SCHED_SLOW") == "1"

TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=400 if SLOW else 40,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.slow
def test_machine_long_runs():
    """More and longer runs (SCHED_SLOW=1 for the full size)."""
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(
        SchedulerMachine,
        settings=settings(
            max_examples=300 if SLOW else 8,
            stateful_step_count=200,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_shadow_catches_a_missing_clear():
    """The shadow model can fail: drop one cleared page from a PREPARE and it sees garbage."""
    cfg = SchedulerConfig(num_kv_pages=8, page_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32)
    d = Driver(Scheduler(cfg))
    d.add(0, [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=4))
    plan = d.s.plan_step()
    prep = plan.prepare
    broken = dataclasses.replace(prep, cleared_pages=prep.cleared_pages[1:])
    table = d.shadow.receive(broken)
    d.shadow.prepare_effects(broken)
    with pytest.raises(ShadowViolation):
        d.shadow.forward(broken, table)
    assert np.array_equal(prep.cleared_pages, np.array([0, 1], dtype=np.int32))


def test_shadow_catches_pages_released_under_a_step_in_flight(monkeypatch):
    """The held-pages check can fail: a scheduler that releases a cancelled request's pages at once,
    while the step that reads them is still in flight, is caught."""
    from scheduler.steps import Steps

    cfg = SchedulerConfig(
        num_kv_pages=8, page_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, max_inflight_steps=2
    )
    d = Driver(Scheduler(cfg))
    d.add(0, [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=4))
    d.plan()
    monkeypatch.setattr(Steps, "_release_when_done", lambda self, req, until=None: self._release(req))
    d.s.cancel(0)
    with pytest.raises(ShadowViolation, match="in flight uses pages"):
        d.check()
