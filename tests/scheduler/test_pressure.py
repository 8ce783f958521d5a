"""A pool far too small for the load: preemption by recompute and by offload, restores, evictions."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from tests.scheduler.sched_sim import Driver


@pytest.mark.parametrize("num_host_pages", [0, 6, 64])
@pytest.mark.parametrize("lookahead", [0, 2])
def test_every_request_finishes_once_under_pressure(num_host_pages, lookahead):
    cfg = SchedulerConfig(
        num_kv_pages=12, page_size=4, max_num_seqs=6, max_num_batched_tokens=16, max_model_len=48,
        eos_token_ids=(1,), num_host_pages=num_host_pages, decode_lookahead=lookahead, poison_freed_pages=True,
    )
    d = Driver(Scheduler(cfg), vocab=30, seed=num_host_pages + lookahead)
    rng = np.random.default_rng(7)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    n = 40
    for rid in range(n):
        tail = rng.integers(2, 30, size=int(rng.integers(1, 14))).tolist()
        prompt = (shared if rid % 2 else []) + tail
        d.add(rid, prompt, SamplingParams(max_tokens=int(rng.integers(4, 20)), ignore_eos=rid % 3 == 0))
    d.run_to_end(max_steps=5000)
    assert sorted(d.finished) == list(range(n))
    assert set(d.finished.values()) <= {"length", "stop"}
    d.check_outputs()
    st = d.s.stats()
    assert st.preemptions_total > 0
    if num_host_pages >= 6:
        assert st.offloads_total > 0 and st.restores_total > 0
    else:
        assert st.offloads_total == 0
    d.s.cache.evict(d.s.cache.evictable_count)
    assert d.s.pool.free_count == cfg.num_kv_pages


def test_lone_request_that_fills_the_pool_always_progresses():
    cfg = SchedulerConfig(num_kv_pages=4, page_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    d = Driver(Scheduler(cfg))
    d.add(0, list(range(3, 10)), SamplingParams(max_tokens=10, ignore_eos=True))  # 16 KV slots: 4 pages
    d.add(1, list(range(3, 10)), SamplingParams(max_tokens=10, ignore_eos=True))
    d.add(2, [20, 21], SamplingParams(max_tokens=14, ignore_eos=True))
    d.run_to_end()
    assert d.finished == {0: "length", 1: "length", 2: "length"}
    d.check_outputs()


def test_fcfs_victim_is_the_newest_running_request():
    cfg = SchedulerConfig(num_kv_pages=6, page_size=4, max_num_seqs=3, max_num_batched_tokens=8, max_model_len=64)
    d = Driver(Scheduler(cfg))
    for rid in range(3):
        d.add(rid, [30 + rid] * 4, SamplingParams(max_tokens=8, ignore_eos=True))
    first_preempted = None
    while d.s.has_work():
        before = {int(x) for x in (d.plans[-1].prepare.seq_ids if d.plans else [])}
        plan = d.step()
        now = set(plan.prepare.seq_ids.tolist())
        if first_preempted is None and before - now - set(d.finished):
            first_preempted = before - now - set(d.finished)
    assert first_preempted == {2}
    # Request 0 was never preempted and finished first.
    assert next(iter(d.finished)) == 0
