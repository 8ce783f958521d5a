"""Planning ahead (max_inflight_steps = 2), one case per test, through the shadow executors: every
PREPARE is applied the executors' way and every read checked (sched_sim.py)."""

from __future__ import annotations

import numpy as np
import pytest

import tests.scheduler.serial_scenarios as scenarios
from scheduler import SamplingParams, Scheduler, SchedulerConfig, SchedulerConfigError, SchedulerStateError
from tests.scheduler.sched_sim import Driver

EOS = 2


def make(inflight: int = 2, seeded: bool = False, **kw) -> Driver:
    base = dict(
        num_kv_pages=16, page_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
        eos_token_ids=(EOS,), max_inflight_steps=inflight,
    )
    base.update(kw)
    return Driver(Scheduler(SchedulerConfig(**base)), vocab=40, seeded_model=seeded)


def params(max_tokens: int = 8, seed: int | None = None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed, **kw)


def pipelined_loop(d: Driver, on_plan=None, max_steps: int = 2000) -> None:
    """The engine's overlapped loop: plan the next step while the previous one is in flight."""
    for _ in range(max_steps):
        if not d.s.has_work():
            return
        if d.can_plan:
            plan = d.plan()
            if plan is not None:
                if on_plan is not None:
                    on_plan(d, plan)
                if d.can_plan:
                    continue
        if d.inflight:
            d.complete()
    raise AssertionError("work left")


def test_continuing_rows_feed_back_the_token_of_the_step_in_flight():
    d = make()
    d.add(0, [5, 6, 7], params())
    d.add(1, [8, 9, 10, 11, 12], params())
    p1 = d.plan()
    assert p1.prepare.feedback.tolist() == [0, 0]
    p2 = d.plan()  # step 1 has not returned: both rows feed back its samples
    assert p2.prepare.feedback.tolist() == [1, 1] and p2.prepare.token_ids.tolist() == [0, 0]
    assert p2.prepare.positions.tolist() == [3, 5] and p2.prepare.page_table_base.tolist() == [1, 2]
    with pytest.raises(SchedulerStateError, match="1 and 2 are still in flight"):
        d.s.plan_step()
    d.complete()
    p3 = d.plan()  # step 2 in flight: feedback again; step 1's tokens are known, not needed
    assert p3.prepare.feedback.tolist() == [1, 1] and p3.prepare.positions.tolist() == [4, 6]
    d.run_to_end()
    d.check_outputs()
    assert d.finished == {0: "length", 1: "length"}


def test_misuse_is_refused_with_a_state_error():
    d = make()
    d.add(0, [5, 6, 7], params())
    p1, p2 = d.plan(), d.plan()
    with pytest.raises(SchedulerStateError, match="not the step in flight"):
        d.s.on_result(p2, d.inflight[1].result)
    with pytest.raises(SchedulerStateError, match="not the newest"):
        d.s.on_abort(p1, "late")
    with pytest.raises(SchedulerConfigError, match="max_inflight_steps"):
        SchedulerConfig(num_kv_pages=4, page_size=4, max_num_seqs=1, max_num_batched_tokens=4, max_model_len=8,
                        max_inflight_steps=3)


@pytest.mark.parametrize("host_pages", [0, 32])
@pytest.mark.parametrize("lookahead", [0, 1])
def test_pipelined_outputs_equal_serial_outputs(host_pages, lookahead):
    """A seeded model: each request's tokens depend on its own KV only, so planning ahead, under
    pressure (evictions, both kinds of preemption, prefix hits), must give every request the
    tokens the serial scheduler gives it."""
    rng = np.random.default_rng(host_pages + lookahead)
    shared = [11, 12, 13, 14, 15, 16, 17, 18]
    reqs = [
        ((shared if i % 2 else []) + rng.integers(3, 40, size=int(rng.integers(1, 10))).tolist(), int(rng.integers(3, 16)))
        for i in range(14)
    ]
    runs = []
    for inflight in (1, 2):
        d = make(inflight, seeded=True, num_kv_pages=9, max_num_seqs=4, max_num_batched_tokens=12,
                 num_host_pages=host_pages, decode_lookahead=lookahead, poison_freed_pages=True)
        for rid, (prompt, max_tokens) in enumerate(reqs):
            d.add(rid, prompt, SamplingParams(max_tokens=max_tokens, seed=rid))
        pipelined_loop(d)
        d.check_outputs()
        runs.append((d.emitted, d.finished, d.s.stats(), d))
    assert runs[0][:2] == runs[1][:2]
    st, d2 = runs[1][2], runs[1][3]
    assert st.preemptions_total > 0 and any(p.prepare.feedback.any() for p in d2.plans)
    if host_pages:
        assert st.offloads_total > 0 and st.restores_total > 0


def test_stop_at_n_with_n_plus_1_already_planned():
    d = make()
    d.add(0, [5, 6, 7, 8], SamplingParams(max_tokens=10))
    d.add(1, [9, 10, 11], SamplingParams(max_tokens=10))
    d.plan()
    p2 = d.plan()
    assert p2.prepare.feedback.tolist() == [1, 1]
    d.forced = {0: EOS, 1: 20}
    outs = d.complete()
    assert [(o.request_id, o.token_ids, o.finish_reason) for o in outs] == [(0, (EOS,), "stop"), (1, (20,), None)]
    held = d.s.request_state(0)
    pages = list(held.page_table)
    assert not held.live and len(pages) == 2 and d.s.running_requests() == (1,)
    p3 = d.plan()  # step 2 still in flight: request 0 is left out
    assert p3.prepare.seq_ids.tolist() == [1]
    outs = d.complete()  # the token step 2 sampled for request 0 is never emitted
    assert [o.request_id for o in outs] == [1]
    assert d.s.request_state(0) is None and int(d.s.pool.refcount[pages].sum()) == 0
    d.run_to_end()
    d.check_outputs()


def test_cancel_with_the_next_step_in_flight():
    d = make()
    d.add(0, [5, 6, 7, 8, 9], params())
    d.plan()
    d.plan()
    d.s.cancel(0)  # both steps in flight: the end is reported now
    assert [(o.request_id, o.finish_reason) for o in d.s.drain_outputs()] == [(0, "cancelled")]
    d.finished[0] = "cancelled"
    assert d.complete() == [] and d.s.request_state(0).page_table == (0, 1)  # step 2 still reads them
    assert d.plan() is None  # nothing else to run
    assert d.complete() == [] and d.s.request_state(0) is None
    assert not d.s.has_work() and d.s.pool.free_count + d.s.cache.evictable_count == 16


def test_length_is_foreseen_a_last_sample_is_not_planned_on():
    d = make()
    d.add(0, [5, 6, 7], params(max_tokens=1))
    d.add(1, [8, 9, 10], params(max_tokens=5))
    d.plan()
    p2 = d.plan()
    assert p2.prepare.seq_ids.tolist() == [1]  # request 0's sample at step 1 is its last
    outs = d.complete()
    assert (0, "length") in [(o.request_id, o.finish_reason) for o in outs]
    d.run_to_end()
    d.check_outputs()


def test_reject_of_n_plus_1_fails_its_requests_and_keeps_n_s_results():
    d = make()
    d.add(0, [5, 6, 7], params(max_tokens=1))  # samples its last token at step 1
    d.add(1, [8, 9, 10], params())
    d.plan()
    p2 = d.plan()
    assert p2.prepare.seq_ids.tolist() == [1]
    outs = d.abort("rank 1 rejected step 2")
    assert [(o.request_id, o.finish_reason) for o in outs] == [(1, "error")]
    outs = d.complete()  # step 1's RESULT still counts: request 0 gets its token
    assert [(o.request_id, len(o.token_ids), o.finish_reason) for o in outs] == [(0, 1, "length")]
    assert not d.s.has_work() and d.s.pool.free_count + d.s.cache.evictable_count == 16
    d.check_outputs()


@pytest.mark.parametrize("result_first", [False, True])
def test_reject_of_n_plus_1_with_the_failed_sequences_rolls_the_others_back(result_first):
    d = make(page_size=4)
    d.add(0, [5, 6, 7, 8], params())  # step 2 writes position 4: a new page
    d.add(1, [9, 10, 11], params())
    d.plan()
    p2 = d.plan()
    new_page = d.s.request_state(0).page_table[1]
    assert new_page in p2.prepare.cleared_pages.tolist()
    if result_first:
        d.complete()
    outs = d.abort("rank 1 rejected sequence 1", failed=[1])
    assert [(o.request_id, o.finish_reason) for o in outs] == [(1, "error")]
    v = d.s.request_state(0)
    assert v.live and v.num_computed == 4 and v.page_table == (0,) and v.reserved_pages == (new_page,)
    assert d.s.pool.marked[new_page]
    p3 = d.plan()  # planned again at once: whole tables, the page listed again
    assert p3.prepare.seq_ids.tolist() == [0] and p3.prepare.page_table_base.tolist() == [0]
    assert new_page in p3.prepare.cleared_pages.tolist()
    assert p3.prepare.feedback.tolist() == ([0] if result_first else [1])
    d.run_to_end()
    d.check_outputs()
    assert d.finished[0] == "length"


def test_reject_of_a_step_that_restores_keeps_the_host_copy():
    d = make(num_kv_pages=6, max_num_seqs=2, num_host_pages=8, max_num_batched_tokens=16)
    d.add(0, list(range(3, 10)), params(max_tokens=10))
    d.add(1, list(range(20, 27)), params(max_tokens=10))
    restored = None
    for _ in range(200):
        plan = d.plan()
        if plan is not None and plan.restored and d.inflight and not d.inflight[-1].ran:
            restored = plan.restored[0][0]
            others = [rid for rid in plan.prepare.seq_ids.tolist() if rid != restored]
            d.abort(failed=others)
            break
        if not d.can_plan or plan is None:
            d.complete()
    assert restored is not None
    v = d.s.request_state(restored)
    assert v.host_slots and v.page_table == () and d.s.waiting_requests()[0] == restored
    d.run_to_end()
    d.check_outputs()
    assert d.finished[restored] == "length"


def _preempted_in_flight(host_pages: int) -> tuple[Driver, list]:
    d = make(seeded=True, num_kv_pages=5, page_size=2, max_num_seqs=2, max_num_batched_tokens=8,
             num_host_pages=host_pages, poison_freed_pages=True)
    d.add(0, [5, 6], SamplingParams(max_tokens=7, seed=1))
    d.add(1, [7, 8], SamplingParams(max_tokens=7, seed=2))
    seen = []

    def on_plan(d, plan):
        if plan.offloaded or d.s.stats().preemptions_total > len(seen):
            victim = d.s.waiting_requests()[0]
            v = d.s.request_state(victim)
            seen.append((plan, victim, v, [f.plan for f in d.inflight[:-1]]))

    pipelined_loop(d, on_plan)
    d.check_outputs()
    return d, seen


def test_preemption_by_recompute_with_a_step_in_flight():
    d, seen = _preempted_in_flight(0)
    plan, victim, v, older = seen[0]
    assert older, "the preemption was planned while a step ran"
    assert not v.live and v.page_table and v.pending_samples == 1  # held for the step in flight
    assert victim not in plan.prepare.seq_ids.tolist()
    serial, _ = _serial_twin(d)
    assert d.emitted == serial


def test_preemption_by_offload_with_a_step_in_flight():
    d, seen = _preempted_in_flight(16)
    plan, victim, v, older = seen[0]
    assert older and plan.offloaded == (victim,)
    # The offload copies the pages the step in flight writes (the executors run steps in order).
    prev = older[-1].prepare
    i = prev.seq_ids.tolist().index(victim)
    assert plan.prepare.offload_pages.tolist() == list(v.page_table)
    assert prev.page_table_lens[i] == len(v.page_table)
    assert d.s.stats().restores_total > 0
    serial, _ = _serial_twin(d)
    assert d.emitted == serial


def _serial_twin(d: Driver):
    cfg = d.s.config
    twin = Driver(Scheduler(SchedulerConfig(**{**cfg.__dict__, "max_inflight_steps": 1})), vocab=d.vocab, seeded_model=True)
    for rid, seed in ((0, 1), (1, 2)):
        twin.add(rid, d.shadow.tokens[rid][: d.prompt_len[rid]], SamplingParams(max_tokens=d.max_tokens[rid], seed=seed))
    twin.run_to_end()
    return twin.emitted, twin


def test_prefix_hits_with_a_step_in_flight_use_only_pages_whose_step_ended():
    d = make(num_kv_pages=32, max_num_seqs=4)
    shared = [11, 12, 13, 14, 15, 16, 17, 18]
    d.add(0, shared + [3], params(max_tokens=6))
    d.plan()  # step 1 writes request 0's two full pages
    d.add(1, shared + [4], params(max_tokens=2))
    p2 = d.plan()  # step 1 in flight: its pages are not snapshots yet
    assert p2.prepare.query_lens.tolist() == [1, 9] and d.s.stats().prefix_hit_pages_total == 0
    d.complete()  # now they are
    d.add(2, shared + [5], params(max_tokens=2))
    p3 = d.plan()  # step 2 in flight: a hit on step 1's pages
    table = d.tables[p3.step]
    snapshot = list(d.s.request_state(0).page_table[:2])
    assert p3.prepare.seq_ids.tolist()[-1] == 2 and p3.prepare.query_lens.tolist()[-1] == 1
    assert table[-3:-1] == snapshot and not set(snapshot) & set(p3.prepare.cleared_pages.tolist())
    d.run_to_end()
    d.check_outputs()


def test_non_finite_at_n_with_n_plus_1_in_flight():
    d = make()
    d.add(0, list(range(3, 12)), params())  # two full pages
    d.plan()
    d.plan()
    outs = d.complete(bad_rows=frozenset({0}))
    assert [(o.request_id, o.finish_reason) for o in outs] == [(0, "error")] and "not finite" in outs[0].error
    d.complete()
    assert d.s.stats().pages_cached == 0  # nothing it wrote is shared
    assert not d.s.has_work()


def test_one_step_at_a_time_plans_the_recorded_serial_prepares():
    """max_inflight_steps = 2 driven one step at a time plans what the serial scheduler planned."""
    original = scenarios.config_for

    def two(rng, big):
        cfg = original(rng, big)
        return SchedulerConfig(**{**cfg.__dict__, "max_inflight_steps": 2})

    import json
    from pathlib import Path

    recorded = {r["seed"]: r for r in json.loads((Path(__file__).parent / "data" / "serial_prepares.json").read_text())}
    scenarios.config_for = two
    try:
        for seed in (0, 1, 4, 7, 9):
            assert scenarios.run(seed)["steps"] == recorded[seed]["steps"]
    finally:
        scenarios.config_for = original
