"""The clearing rule of DESIGN.md and seed 004, one case per test, through the public scheduler."""

from __future__ import annotations

import numpy as np

from scheduler import PagePool, SamplingParams, Scheduler, SchedulerConfig
from tests.scheduler.sched_sim import Driver


def make(**kw) -> Driver:
    base = dict(num_kv_pages=8, page_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    base.update(kw)
    return Driver(Scheduler(SchedulerConfig(**base)))


def listed_in(d: Driver) -> dict[int, list[int]]:
    """page -> steps whose PREPARE listed it."""
    out: dict[int, list[int]] = {}
    for plan in d.plans:
        for page in plan.prepare.cleared_pages.tolist():
            out.setdefault(page, []).append(plan.step)
    return out


def first_use(d: Driver) -> dict[int, int]:
    """page -> first step whose page tables contain it, counted again after each time it was freed."""
    seen: dict[int, int] = {}
    for plan in d.plans:
        for page in d.tables[plan.step]:
            seen.setdefault(page, plan.step)
    return seen


def test_fresh_pages_listed_on_first_use_only():
    d = make(max_num_batched_tokens=4)
    d.add(0, list(range(3, 12)), SamplingParams(max_tokens=8))  # 9 tokens, chunks of 4
    d.run_to_end()
    listed = listed_in(d)
    # Every page the request used was listed exactly once, in the step that first put it in a table.
    assert listed and all(len(steps) == 1 for steps in listed.values())
    assert {p: s[0] for p, s in listed.items()} == first_use(d)
    # Chunked prefill: page k is committed by the step whose chunk first writes into it.
    assert [p.prepare.cleared_pages.tolist() for p in d.plans[:3]] == [[0], [1], [2]]


def test_released_snapshot_pages_listed_exactly_once_when_first_committed():
    d = make(num_kv_pages=4, max_num_batched_tokens=4)
    d.add(0, [9, 9, 9, 9, 8, 8, 8, 8], SamplingParams(max_tokens=1))
    d.run_to_end()
    s = d.s
    # Request 0's two full pages stay behind as snapshots nobody references.
    assert s.stats().pages_cached == 2 and s.cache.evictable_count == 2
    assert not s.pool.marked[[0, 1]].any()
    steps_before = len(d.plans)
    d.add(1, list(range(3, 16)), SamplingParams(max_tokens=1))  # 13 tokens: needs all 4 pages
    d.run_to_end()
    later = d.plans[steps_before:]
    # The evicted snapshot pages returned marked and are listed once each, by the step that first
    # commits them into request 1's page table; nothing is listed at eviction or reservation.
    per_step = [p.prepare.cleared_pages.tolist() for p in later]
    assert per_step == [[2], [3], [1], [0]]
    for plan, cleared in zip(later, per_step):
        table = d.tables[plan.step]
        assert table[-1] == cleared[0]
        assert cleared[0] not in table[:-1]
    assert s.stats().evictions_total == 2


def test_nothing_listed_at_release_or_reservation():
    d = make(decode_lookahead=2)
    d.add(0, [5, 6, 7, 8], SamplingParams(max_tokens=10, ignore_eos=True))
    plan = d.step()
    assert plan.prepare.cleared_pages.tolist() == [0]
    plan = d.step()  # decode at position 4 commits page 1 and reserves two more
    assert plan.prepare.cleared_pages.tolist() == [1]
    reserved = list(d.s.request_state(0).reserved_pages)
    assert reserved == [2, 3] and d.s.pool.marked[reserved].all()
    assert d.s.stats().pages_reserved == 2
    for _ in range(3):  # positions 5..7 stay in page 1
        assert d.step().prepare.cleared_pages.size == 0
    plan = d.step()  # position 8 commits the first reserved page: listed now, not at reservation
    assert plan.prepare.cleared_pages.tolist() == [2]
    d.run_to_end()
    # Position 12 commits the second reserved page; the release at finish listed nothing.
    listed = listed_in(d)
    assert listed == {0: [1], 1: [2], 2: [6], 3: [10]} and len(d.plans) == 10
    assert {p: s[0] for p, s in listed.items()} == first_use(d)
    assert d.s.pool.free_count == 8 - d.s.cache.evictable_count


def test_mark_survives_cancelled_reservation():
    d = make(decode_lookahead=2)
    d.add(0, [5, 6, 7, 8], SamplingParams(max_tokens=10, ignore_eos=True))
    d.step()
    d.step()
    reserved = list(d.s.request_state(0).reserved_pages)
    d.s.cancel(0)
    assert [o.finish_reason for o in d.s.drain_outputs()] == ["cancelled"]
    pool = d.s.pool
    assert all(pool.is_free(p) for p in reserved) and pool.marked[reserved].all()
    # The next request to commit them lists them, once.
    d.add(1, list(range(20, 32)), SamplingParams(max_tokens=1))
    d.run_to_end()
    listed = listed_in(d)
    assert all(listed[p] == [d.plans[-1].step] for p in reserved)


def test_mark_survives_reservation_dropped_under_pressure():
    d = make(num_kv_pages=6, decode_lookahead=2)
    d.add(0, [5, 6, 7, 8], SamplingParams(max_tokens=12, ignore_eos=True))
    d.step()
    d.step()
    reserved = list(d.s.request_state(0).reserved_pages)
    # A newcomer needs the reserved pages: the reservation goes back, marks intact.
    d.add(1, list(range(20, 31)), SamplingParams(max_tokens=1))
    d.step()
    pool = d.s.pool
    listed = listed_in(d)
    assert d.finished == {1: "length"}
    # Request 1 got them (a LIFO pool hands back the last returned first) and listed each once.
    assert all(listed[p] == [3] for p in reserved)
    assert all(pool.is_free(p) or d.s.cache.is_cached(p) for p in reserved)


def test_snapshot_reuse_lists_nothing_and_keeps_marks():
    d = make(num_kv_pages=8)
    shared = [11, 12, 13, 14, 15, 16, 17, 18]
    d.add(0, shared + [3], SamplingParams(max_tokens=6, ignore_eos=True))
    d.step()
    d.step()
    snapshot = list(d.s.request_state(0).page_table[:2])
    assert all(d.s.cache.is_cached(p) for p in snapshot)
    marked_before = d.s.pool.marked.copy()
    d.add(1, shared + [4, 5], SamplingParams(max_tokens=2))
    plan = d.step()
    table = d.tables[plan.step]
    # Request 1 shares request 0's two pages zero-copy: they are in its table, never listed, and
    # reuse changed no mark except the fresh page it committed for its own tail.
    assert table.count(snapshot[0]) == 2 and table.count(snapshot[1]) == 2
    assert not set(snapshot) & set(plan.prepare.cleared_pages.tolist())
    fresh = plan.prepare.cleared_pages.tolist()
    changed = np.flatnonzero(marked_before != d.s.pool.marked).tolist()
    assert changed == fresh
    assert d.s.stats().prefix_hit_pages_total == 2
    d.run_to_end()


def test_restore_targets_never_listed():
    d = make(num_kv_pages=6, max_num_seqs=2, num_host_pages=8)
    d.add(0, list(range(3, 10)), SamplingParams(max_tokens=10, ignore_eos=True))
    d.add(1, list(range(20, 27)), SamplingParams(max_tokens=10, ignore_eos=True))
    d.run_to_end()
    offloads = [p for p in d.plans if p.prepare.offload_pages.size]
    restores = [p for p in d.plans if p.prepare.restore_pages.size]
    assert offloads and restores
    for plan in restores:
        targets = set(plan.prepare.restore_pages.tolist())
        assert not targets & set(plan.prepare.cleared_pages.tolist())
    # A restore target is never listed while its request holds it (it was overwritten whole).
    first = restores[0]
    targets = first.prepare.restore_pages.tolist()
    rid = int(first.prepare.seq_ids[-1])
    for plan in d.plans[d.plans.index(first) :]:
        ids = plan.prepare.seq_ids.tolist()
        if rid not in ids:
            break
        assert not set(targets) & set(plan.prepare.cleared_pages.tolist())
    assert d.s.stats().restores_total == d.s.stats().offloads_total


def test_aborted_step_remarks_its_cleared_pages():
    d = make()
    d.add(0, [5, 6, 7, 8, 9], SamplingParams(max_tokens=4))
    plan = d.plan()
    cleared = plan.prepare.cleared_pages.tolist()
    assert cleared == [0, 1] and not d.s.pool.marked[cleared].any()
    outs = d.abort("rank 1 timed out")
    assert [(o.request_id, o.finish_reason) for o in outs] == [(0, "error")]
    assert "rank 1 timed out" in outs[0].error
    assert d.s.pool.marked[cleared].all()
    # Nothing from the aborted step became a snapshot; the next user lists the pages again.
    assert d.s.stats().pages_cached == 0
    d.add(1, [5, 6, 7, 8, 9], SamplingParams(max_tokens=1))
    plan = d.step()
    assert set(cleared) <= set(plan.prepare.cleared_pages.tolist())


def test_pool_marks_every_page_at_start_and_at_free():
    pool = PagePool(4)
    assert pool.marked.all()
    pages = pool.allocate(2)
    assert pool.commit(pages).tolist() == pages.tolist()
    assert pool.commit(pages).size == 0  # listed once only
    pool.free(pool.decref(pages))
    assert pool.marked.all() and pool.free_count == 4
