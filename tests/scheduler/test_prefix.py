"""Prefix keys: hashing one page of many rows at once gives the keys hashed one by one."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.prefix import PrefixHasher


@settings(max_examples=100, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4, 16]), data=st.data())
def test_hashing_one_page_of_many_rows_equals_extend(page_size, data):
    h = PrefixHasher(page_size, 64, seed=data.draw(st.integers(0, 2**32)))
    rows = data.draw(st.integers(1, 6))
    streams, starts, states, want = [], [], [], []
    for _ in range(rows):
        pages = data.draw(st.integers(1, 64 // page_size))
        size = pages * page_size
        tokens = np.array(data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=size, max_size=size)), dtype=np.int32)
        keys, _ = h.extend((0, 0), tokens, 0, pages * page_size)
        start = (pages - 1) * page_size
        streams.append(tokens[start:])
        starts.append(start)
        states.append(keys[-2] if pages > 1 else (0, 0))
        want.append(keys[-1])
    assert h.next_pages(states, np.stack(streams), np.array(starts)) == want


def test_a_page_of_token_zero_has_a_key_of_its_own():
    """Token 0 counts: a page of zeros does not take the key of the prefix before it (which made a
    later prompt hit the first page twice, reading its KV where the zeros' belonged)."""
    h = PrefixHasher(2, 8, seed=1)
    keys, _ = h.extend((0, 0), np.array([5, 6, 0, 0, 0, 0], dtype=np.int32), 0, 6)
    assert len(set(keys)) == 3
    assert h.next_pages([keys[1]], np.array([[0, 0]], dtype=np.int32), np.array([4])) == [keys[2]]


def test_prompts_with_a_page_of_zeros_share_the_right_pages():
    from scheduler import SamplingParams, Scheduler, SchedulerConfig
    from tests.scheduler.sched_sim import Driver

    d = Driver(Scheduler(SchedulerConfig(num_kv_pages=16, page_size=2, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=16)))
    d.add(0, [5, 6, 0, 0, 9], SamplingParams(max_tokens=1))
    d.run_to_end()
    d.add(1, [5, 6, 0, 0, 7], SamplingParams(max_tokens=1))
    plan = d.plan()
    table = d.tables[plan.step]
    assert plan.prepare.query_lens.tolist() == [1] and table[0] != table[1]
    d.complete()
