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
