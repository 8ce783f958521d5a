"""stats(): the counters /metrics exports, checked against a workload whose numbers are known."""

from __future__ import annotations

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from tests.scheduler.sched_sim import Driver


def test_prefix_queries_and_hits_count_tokens_as_vllm_does():
    d = Driver(Scheduler(SchedulerConfig(num_kv_pages=32, page_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                         max_model_len=64)))
    shared = list(range(10, 22))  # three full pages
    d.add(0, shared + [3], SamplingParams(max_tokens=1))
    d.run_to_end()
    d.add(1, shared + [4, 5], SamplingParams(max_tokens=1))  # hits the three pages: 12 of 14 tokens
    d.add(2, [40, 41, 42], SamplingParams(max_tokens=1))  # hits nothing
    d.run_to_end()
    st = d.s.stats()
    assert (st.prefix_queries_total, st.prefix_hits_total, st.prefix_hit_pages_total) == (13 + 14 + 3, 12, 3)


def test_offloads_and_restores_count_requests_and_pages():
    cfg = SchedulerConfig(num_kv_pages=6, page_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=48,
                          num_host_pages=16)
    d = Driver(Scheduler(cfg))
    d.add(0, list(range(3, 10)), SamplingParams(max_tokens=10, ignore_eos=True))
    d.add(1, list(range(20, 27)), SamplingParams(max_tokens=10, ignore_eos=True))
    offloaded = restored = 0
    while d.s.has_work():
        plan = d.plan()
        offloaded += plan.prepare.offload_pages.shape[0]
        restored += plan.prepare.restore_pages.shape[0]
        assert d.s.stats().pages_cleared_last_step == plan.prepare.cleared_pages.shape[0]
        d.complete()
    st = d.s.stats()
    assert st.offloads_total >= 1 and st.restores_total == st.offloads_total
    assert st.pages_offloaded_total == offloaded > st.offloads_total
    assert st.pages_restored_total == restored == offloaded
