"""n > 1 samples of one prompt: followers wait for their leader's prompt pages and share them by
reference (add_request(..., prompt_leader=...)), through the shadow executors."""

from __future__ import annotations

import pytest

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from tests.scheduler.sched_sim import Driver

PROMPT = list(range(10, 23))  # 13 tokens: three full pages of 4 and a tail of 1


def make(inflight: int = 1, **kw) -> Driver:
    base = dict(num_kv_pages=40, page_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                max_inflight_steps=inflight)
    base.update(kw)
    return Driver(Scheduler(SchedulerConfig(**base)), vocab=40, seeded_model=True)


def run(d: Driver) -> None:
    for _ in range(1000):
        if not d.s.has_work():
            break
        if d.can_plan and d.plan() is not None and d.can_plan:
            continue
        if d.inflight:
            d.complete()
    d.check_outputs()


@pytest.mark.parametrize("inflight", [1, 2])
def test_followers_share_the_leader_s_prompt_pages_by_reference(inflight):
    d = make(inflight)
    d.add(0, PROMPT, SamplingParams(max_tokens=6, seed=0))
    for rid in (1, 2, 3):
        d.add(rid, PROMPT, SamplingParams(max_tokens=6, seed=rid), prompt_leader=0)
    p1 = d.plan()
    assert p1.prepare.seq_ids.tolist() == [0]  # the followers wait, though seats and budget allow them
    assert d.s.request_state(1).prefix_leader == 0
    d.complete()  # the leader's prompt is computed: its full pages are snapshots now
    p2 = d.plan()
    assert p2.prepare.seq_ids.tolist() == [0, 1, 2, 3]
    assert p2.prepare.query_lens.tolist() == [1, 1, 1, 1]  # each follower computes the prompt's last token only
    shared = d.s.request_state(0).page_table[:3]
    for rid in (1, 2, 3):
        v = d.s.request_state(rid)
        assert v.page_table[:3] == shared and v.prefix_leader is None
    assert d.s.pool.refcount[list(shared)].tolist() == [4, 4, 4]
    assert not set(shared) & set(p2.prepare.cleared_pages.tolist())
    assert d.s.stats().prefix_hit_pages_total == 9 and d.s.stats().prefix_hits_total == 36
    run(d)


@pytest.mark.parametrize("inflight", [1, 2])
def test_followers_emit_what_independent_requests_emit(inflight):
    """A seeded model: the n samples are the tokens n independent requests with those seeds give."""
    outs = []
    for lead in (True, False):
        d = make(inflight, max_num_batched_tokens=8)  # the prompt takes two chunks
        for rid in range(4):
            kw = {"prompt_leader": 0} if lead and rid else {}
            d.add(rid, PROMPT, SamplingParams(max_tokens=10, temperature=0.8, seed=100 + rid), **kw)
        run(d)
        outs.append(d.emitted)
        hits = d.s.stats().prefix_hit_pages_total
        assert (hits == 9) if lead else (hits < 9)
    assert outs[0] == outs[1] and len(set(map(tuple, outs[0].values()))) > 1


def test_a_follower_goes_on_alone_if_its_leader_ends_first():
    d = make(max_num_batched_tokens=8)
    d.add(0, PROMPT, SamplingParams(max_tokens=4, seed=0))
    d.add(1, PROMPT, SamplingParams(max_tokens=4, seed=1), prompt_leader=0)
    d.plan()  # the leader's first chunk: two of the three full pages
    d.complete()
    d.s.cancel(0)
    d.take(d.s.drain_outputs())
    p = d.plan()  # the follower computes the rest itself (the two pages done are still shared)
    assert p.prepare.seq_ids.tolist() == [1] and p.prepare.query_lens.tolist() == [5]
    run(d)
    assert d.finished == {0: "cancelled", 1: "length"}


def test_an_unknown_leader_or_no_prefix_cache_means_no_waiting():
    d = make(enable_prefix_cache=False)
    d.add(0, PROMPT, SamplingParams(max_tokens=2))
    d.add(1, PROMPT, SamplingParams(max_tokens=2), prompt_leader=0)
    d.add(2, PROMPT, SamplingParams(max_tokens=2), prompt_leader=99)
    assert d.plan().prepare.seq_ids.tolist() == [0, 1, 2]
    run(d)


def test_requests_behind_waiting_followers_keep_their_order():
    d = make(max_num_batched_tokens=8)
    d.add(0, PROMPT, SamplingParams(max_tokens=3))
    d.add(1, PROMPT, SamplingParams(max_tokens=3), prompt_leader=0)
    d.add(2, [30, 31], SamplingParams(max_tokens=3))
    d.add(3, [32, 33], SamplingParams(max_tokens=3))
    assert d.plan().prepare.seq_ids.tolist() == [0]  # the leader's first chunk takes the budget
    d.complete()
    p2 = d.plan()  # the follower still waits (one of its pages is not done): 2 and 3 go ahead, in order
    assert p2.prepare.seq_ids.tolist() == [0, 2, 3] and p2.prepare.query_lens.tolist() == [5, 2, 1]
    d.complete()
    assert d.plan().prepare.seq_ids.tolist() == [0, 2, 3, 1]
    run(d)
    assert d.s.stats().prefix_hit_pages_total == 3
